"""LoRA adapters as models: which adapters the API serves, and which tenants may use each.

A request selects an adapter by its `model` field, as with vLLM: the base model's id runs the
base model, an adapter's name runs that adapter (`resolve`). Adapters come from the app config
(`lora_adapters`) and from the admin API at run time (`add`, `remove`). An adapter whose
`tenants` is None may be used by every tenant; otherwise only by those named.

Each load gets its own engine identity (`LoRARequest.name`: the adapter's name the first time,
`name#2`, `name#3`, ... after an unload and a new load under the same name), so a reloaded
adapter never reuses the weights or the prefix-cache blocks of the one it replaced. Unloading
refuses new requests at once; requests already accepted run to their end on the weights they
started with.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairbatch.deployments.api.schemas import ApiError
from fairbatch.engine.sampling_params import LoRARequest


@dataclass(frozen=True)
class LoRAEntry:
    name: str  # the `model` id clients use
    lora: LoRARequest  # what the engine runs (its engine identity and directory)
    tenants: frozenset[str] | None  # who may use it; None: every tenant

    def allows(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    def public(self) -> dict:
        tenants = None if self.tenants is None else sorted(self.tenants)
        return {"name": self.name, "path": self.lora.path, "tenants": tenants}


class LoRARegistry:
    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self.entries: dict[str, LoRAEntry] = {}
        self._loads: dict[str, int] = {}  # name -> loads so far (for its engine identity)

    def entry(self, name: str, path: str, tenants: list[str] | None) -> LoRAEntry:
        """The entry a load of `name` from `path` would add (not added yet)."""
        if name == self.base_model:
            raise ApiError(400, f"{name!r} is the base model's id", param="name")
        if name in self.entries:
            raise ApiError(
                409, f"LoRA adapter {name!r} is already loaded; unload it first", param="name",
                code="lora_exists",
            )  # fmt: skip
        n = self._loads.get(name, 0) + 1
        lora = LoRARequest(name if n == 1 else f"{name}#{n}", path)
        return LoRAEntry(name, lora, None if tenants is None else frozenset(tenants))

    def add(self, entry: LoRAEntry) -> None:
        self.entry(entry.name, entry.lora.path, None)  # (still not loaded, not the base)
        self._loads[entry.name] = self._loads.get(entry.name, 0) + 1
        self.entries[entry.name] = entry

    def adopt(self, name: str, lora: LoRARequest, tenants: frozenset[str] | None) -> None:
        """Serve an adapter loaded through another ingress, under the engine identity it got
        there (a later load here of the same name gets a new one)."""
        self.entries[name] = LoRAEntry(name, lora, tenants)
        _, _, n = lora.name.partition("#")
        self._loads[name] = max(self._loads.get(name, 0), int(n or 1))

    def remove(self, name: str) -> LoRAEntry:
        entry = self.entries.pop(name, None)
        if entry is None:
            raise ApiError(404, f"no LoRA adapter {name!r} is loaded", code="lora_not_found")
        return entry

    def visible(self, tenant: str) -> list[LoRAEntry]:
        return [e for e in self.entries.values() if e.allows(tenant)]

    def resolve(self, model: str, tenant: str) -> LoRARequest | None:
        """What a request whose `model` is `model` runs: None for the base model, else its
        adapter; 404 for an unknown model, 403 for an adapter the tenant may not use."""
        if model == self.base_model:
            return None
        entry = self.entries.get(model)
        if entry is None:
            known = [self.base_model, *(e.name for e in self.visible(tenant))]
            names = ", ".join(repr(n) for n in known)
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves {names}",
                param="model",
                code="model_not_found",
            )
        if not entry.allows(tenant):
            raise ApiError(
                403,
                f"tenant {tenant!r} may not use the LoRA adapter '{model}'",
                type="permission_error",
                param="model",
                code="model_not_permitted",
            )
        return entry.lora
