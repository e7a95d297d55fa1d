"""Admin changes to tenants, kept where restarts cannot lose them.

A PATCH reaches the controller from whichever ingress served it. The controller keeps each
changed tenant's settings as they are after the change, under a version that grows with every
change, and writes them to Ray's GCS key-value store under the cluster's name. A restarted
controller reads them back before it takes requests; an ingress asks for them when it starts
(a change wins over its config's values) and polls for newer ones, so a change made through
another ingress reaches it. GCS outlives every actor and job on the Ray cluster; it outlives the
head node only with GCS fault tolerance (Redis).
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


class TenantChanges:
    """The changed tenants, their version, and where they are saved (`kv` None: nowhere)."""

    def __init__(self, kv: KeyValue | None, key: str) -> None:
        self.kv, self.key = kv, key
        self.version = 0
        self.tenants: dict[str, TenantSettings] = {}

    def load(self) -> dict[str, TenantSettings]:
        """What was saved (a store that cannot be read leaves nothing: logged)."""
        if self.kv is None:
            return dict(self.tenants)
        try:
            raw = self.kv.get(self.key)
        except Exception:
            log.error("could not read the tenant changes at %s", self.key, exc_info=True)
            return dict(self.tenants)
        if raw:
            saved = json.loads(raw)
            self.version = saved["version"]
            self.tenants = {n: TenantSettings(**s) for n, s in saved["tenants"].items()}
        return dict(self.tenants)

    def set(self, name: str, settings: TenantSettings) -> int:
        """Record a change and save all of them; returns the new version. A store that cannot
        be written raises (the PATCH then fails and is undone)."""
        tenants = {**self.tenants, name: settings}
        if self.kv is not None:  # saved first: a failed write changes nothing
            body = {
                "version": self.version + 1,
                "tenants": {n: asdict(s) for n, s in tenants.items()},
            }
            self.kv.put(self.key, json.dumps(body).encode())
        self.tenants = tenants
        self.version += 1
        return self.version

    def since(self, version: int) -> tuple[int, dict[str, TenantSettings]] | None:
        """The changes if there are newer ones than `version`, else None."""
        if version >= self.version:
            return None
        return self.version, dict(self.tenants)
