"""Admin changes as the controller keeps them (deployments/cluster/admin_store.py): saved on
every change, read back by the next controller, versioned for the ingresses' polls."""

from __future__ import annotations

import pytest

from fairbatch.deployments.cluster.admin_store import AdminChanges, LoRASettings, TenantSettings


class DictKV:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.fail = False

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        if self.fail:
            raise OSError("store unavailable")
        self.data[key] = value


def test_changes_are_saved_and_read_back_by_the_next_controller():
    kv = DictKV()
    first = AdminChanges(kv, "admin/app")
    assert first.load().version == 0 and first.since(0) is None
    assert first.set_tenant("a", TenantSettings(3.0, 1, 600.0, None)) == 1
    assert first.set_tenant("b", TenantSettings(1.0, 0, None, 4)) == 2
    assert first.set_tenant("a", TenantSettings(2.0, 1, None, None)) == 3
    assert first.set_lora("x", LoRASettings("x#2", "/loras/x", ("a",))) == 4
    assert first.set_lora("y", None) == 5  # unloaded: stays unloaded
    restarted = AdminChanges(kv, "admin/app").load()
    assert restarted.version == 5
    assert restarted.tenants == {
        "a": TenantSettings(2.0, 1, None, None),
        "b": TenantSettings(1.0, 0, None, 4),
    }
    assert restarted.loras == {"x": LoRASettings("x#2", "/loras/x", ("a",)), "y": None}
    again = AdminChanges(kv, "admin/app")
    again.load()
    assert again.since(5) is None and again.since(1) == restarted
    assert AdminChanges(kv, "admin/other").load().tenants == {}  # per app


def test_a_change_the_store_refuses_changes_nothing():
    kv = DictKV()
    changes = AdminChanges(kv, "k")
    changes.set_tenant("a", TenantSettings(1.0, 0))
    kv.fail = True
    with pytest.raises(OSError):
        changes.set_tenant("a", TenantSettings(5.0, 0))
    with pytest.raises(OSError):
        changes.set_lora("x", None)
    assert changes.now.tenants == {"a": TenantSettings(1.0, 0)} and changes.now.version == 1
    assert changes.now.loras == {}


def test_without_a_store_changes_live_in_memory():
    changes = AdminChanges(None, "")
    changes.set_tenant("a", TenantSettings(2.0, 0))
    assert changes.load().tenants == {"a": TenantSettings(2.0, 0)}
    assert changes.since(0).version == 1
