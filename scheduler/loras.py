"""Which requests' LoRA adapters are in the model's adapter slots (issue 46).

A request naming an adapter (`Request.lora_name`) runs only while its adapter sits in one of
the pool's slots (engine/lora.py's `LoRAPool`, duck-typed here: `can_load`, `load`, `release`).
A running request pins its adapter's slot (`start`) and unpins it when it stops running
(`stop`: finished, aborted or preempted; resumed, it pins again). A slot nobody pins may be
given to another adapter.

When a waiting request finds every slot pinned by running requests of other adapters, it
becomes the *waiter*: it has the turn for the next slot, and one adapter in use, the one with
the fewest running requests (then the first by name), is chosen to give its slot up (the
*draining* adapter). Until the waiter starts, other waiting requests still overtake it if they
need no slot of their own: base-model requests, and requests of an adapter that running
requests pin now, except the draining one. Everything else waits: requests of the draining
adapter, and of any adapter that would need a slot (loaded or not). So no new request pins the
draining adapter's slot; its running requests finish (or are preempted), the slot frees, and
the waiter is the only waiting request that may take it. The waiter cannot starve, while
base-model work and the other adapters in use keep flowing. (Allowing every adapter in use to
overtake would let a steady stream of one adapter's requests keep its slot pinned forever.)

Which of a tenant's waiting requests comes first in policy order is not decided here: the
adapters of one tenant share its service by a counter per adapter (policies/flows.py), and
the tenant is charged its tokens whatever adapter they went to (a load costs it nothing).

Only waiting requests take or respect the turn. A swapped-out request resumes as before, when
its adapter can be loaded (it is work already started, and there are only ever as many as
were preempted). There is one waiter at a time; a second request that finds no slot waits
behind it, like any request that needs a slot.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class LoRASlots:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.adapters: dict[str, Any] = {}  # name -> the LoRAAdapter that `load` writes
        self.running: Counter[str] = Counter()  # adapter -> running requests (its slot's pins)
        self.waiter: Any = None  # the waiting request with the turn for the next free slot
        self.draining: str | None = None  # the adapter whose slot the waiter will get

    def can_start(self, request) -> bool:
        """Whether the waiting `request` may start now, as far as adapter slots go."""
        name = request.lora_name
        if name is None:
            return True
        if self.waiter is not None and self.waiter is not request:
            return self.running[name] > 0 and name != self.draining
        if self.pool.can_load(name):
            return True
        self.waiter = request
        if not self.running[self.draining]:  # none chosen yet, or another slot took its place
            self.draining = min(self.running, key=lambda a: (self.running[a], a), default=None)
        return False

    def can_resume(self, request) -> bool:
        """Whether the swapped-out `request` may come back now (its adapter can be loaded)."""
        name = request.lora_name
        return name is None or self.pool.can_load(name)

    def start(self, request) -> None:
        name = request.lora_name
        if name is not None:
            self.pool.load(name, self.adapters[name])
            self.running[name] += 1
        if request is self.waiter:
            self.waiter = self.draining = None

    def stop(self, request) -> None:
        name = request.lora_name
        if name is not None:
            self.pool.release(name)
            self.running[name] -= 1
            if not self.running[name]:
                del self.running[name]

    def forget(self, request) -> None:
        """`request` leaves the scheduler without running (aborted, timed out, exported)."""
        if request is self.waiter:
            self.waiter = self.draining = None
