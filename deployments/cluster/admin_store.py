"""Admin changes (tenants' settings, LoRA adapters), kept where restarts cannot lose them.

A PATCH of a tenant, or a load or unload of a LoRA adapter, reaches the controller from
whichever ingress served it. The controller keeps the changed tenants' settings and the changed
adapters (an unloaded one as None, so it stays unloaded even where a config lists it) under a
version that grows with every change, and writes them to Ray's GCS key-value store under the
app's name. A restarted controller reads them back before it takes requests; an ingress asks for
them when it starts (a change wins over its config) and polls for newer ones, so a change made
through another ingress reaches it. GCS outlives every actor and job on the Ray cluster; it
outlives the head node only with GCS fault tolerance (Redis).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Protocol

log = logging.getLogger(__name__)

NAMESPACE = "fairbatch"


@dataclass(frozen=True)
class TenantSettings:
    """A tenant's admin-changeable settings (None: no quota / the default bound)."""

    weight: float
    priority: int
    tokens_per_minute: float | None = None
    max_requests: int | None = None


@dataclass(frozen=True)
class LoRASettings:
    """A loaded adapter: its model id's engine identity (the same on every ingress), its
    directory, and the tenants that may use it (None: all)."""

    engine_name: str
    path: str
    tenants: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Changes:
    version: int
    tenants: dict[str, TenantSettings]
    loras: dict[str, LoRASettings | None]  # None: unloaded


class KeyValue(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes) -> None: ...


class GcsKeyValue:
    """Ray's GCS key-value store (needs a connected Ray)."""

    def get(self, key: str) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        return _internal_kv_get(key, namespace=NAMESPACE)

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


def _lora(saved: dict) -> LoRASettings:
    who = saved["tenants"]
    return LoRASettings(saved["engine_name"], saved["path"], None if who is None else tuple(who))


class AdminChanges:
    """The changes, their version, and where they are saved (`kv` None: nowhere)."""

    def __init__(self, kv: KeyValue | None, key: str) -> None:
        self.kv, self.key = kv, key
        self.now = Changes(0, {}, {})

    def load(self) -> Changes:
        """What was saved (a store that cannot be read leaves what is held: logged)."""
        if self.kv is None:
            return self.now
        try:
            raw = self.kv.get(self.key)
        except Exception:
            log.error("could not read the admin changes at %s", self.key, exc_info=True)
            return self.now
        if raw:
            saved = json.loads(raw)
            loras = {n: None if s is None else _lora(s) for n, s in saved["loras"].items()}
            tenants = {n: TenantSettings(**s) for n, s in saved["tenants"].items()}
            self.now = Changes(saved["version"], tenants, loras)
        return self.now

    def set_tenant(self, name: str, settings: TenantSettings) -> int:
        return self._save(Changes(self.now.version + 1, {**self.now.tenants, name: settings},
                                  self.now.loras))  # fmt: skip

    def set_lora(self, name: str, settings: LoRASettings | None) -> int:
        return self._save(Changes(self.now.version + 1, self.now.tenants,
                                  {**self.now.loras, name: settings}))  # fmt: skip

    def _save(self, changes: Changes) -> int:
        """Saved first, then held: a store that cannot be written raises and changes nothing
        (the admin call then fails and is undone). Returns the new version."""
        if self.kv is not None:
            body = {
                "version": changes.version,
                "tenants": {n: asdict(s) for n, s in changes.tenants.items()},
                "loras": {n: None if s is None else asdict(s) for n, s in changes.loras.items()},
            }
            self.kv.put(self.key, json.dumps(body).encode())
        self.now = changes
        return changes.version

    def since(self, version: int) -> Changes | None:
        """The changes if there are newer ones than `version`, else None."""
        return None if version >= self.now.version else self.now
