"""Admin changes to tenants as the controller keeps them (deployments/cluster/tenant_store.py):
saved on every change, read back by the next controller, versioned for the ingresses' polls."""

from __future__ import annotations

import pytest

from fairbatch.deployments.cluster.tenant_store import TenantChanges, TenantSettings


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
    first = TenantChanges(kv, "tenants/app")
    assert first.load() == {} and first.since(0) is None
    assert first.set("a", TenantSettings(3.0, 1, 600.0, None)) == 1
    assert first.set("b", TenantSettings(1.0, 0, None, 4)) == 2
    assert first.set("a", TenantSettings(2.0, 1, None, None)) == 3
    restarted = TenantChanges(kv, "tenants/app")
    assert restarted.load() == {
        "a": TenantSettings(2.0, 1, None, None),
        "b": TenantSettings(1.0, 0, None, 4),
    }
    assert restarted.version == 3
    assert restarted.since(3) is None
    assert restarted.since(1) == (3, restarted.tenants)
    assert TenantChanges(kv, "tenants/other").load() == {}  # per app


def test_a_change_the_store_refuses_changes_nothing():
    kv = DictKV()
    changes = TenantChanges(kv, "k")
    changes.set("a", TenantSettings(1.0, 0))
    kv.fail = True
    with pytest.raises(OSError):
        changes.set("a", TenantSettings(5.0, 0))
    assert changes.tenants == {"a": TenantSettings(1.0, 0)} and changes.version == 1


def test_without_a_store_changes_live_in_memory():
    changes = TenantChanges(None, "")
    changes.set("a", TenantSettings(2.0, 0))
    assert changes.load() == {"a": TenantSettings(2.0, 0)} and changes.since(0)[0] == 1
