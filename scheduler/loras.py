"""Which requests' LoRA adapters are in the model's adapter slots (issue 46).

A request naming an adapter (`Request.lora_name`) runs only while its adapter sits in one of
the pool's slots (engine/lora.py's `LoRAPool`, duck-typed here: `can_load`, `load`, `release`).
The scheduler asks `can_start` before it admits or swaps in such a request; if every slot
holds an adapter that running requests use, the request waits its turn, as it would for KV
blocks (head of line: later requests do not overtake it, and running ones keep running,
finish and free a slot). A running request pins its adapter's slot (`start`) and unpins it
when it stops running (`stop`: finished, aborted or preempted; resumed, it pins again).
"""

from __future__ import annotations

from typing import Any


class LoRASlots:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.adapters: dict[str, Any] = {}  # name -> the LoRAAdapter that `load` writes

    def can_start(self, request) -> bool:
        name = request.lora_name
        return name is None or self.pool.can_load(name)

    def start(self, request) -> None:
        name = request.lora_name
        if name is not None:
            self.pool.load(name, self.adapters[name])

    def stop(self, request) -> None:
        if request.lora_name is not None:
            self.pool.release(request.lora_name)
