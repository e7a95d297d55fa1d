"""Queue machinery shared by the policies: entries, lazy-deletion heaps, per-tenant queues.

Every queued request is wrapped in one `Entry` whose `key` is its place inside its tenant:
`(0, seq, n)` when requeued (preempted work goes first, in `.seq` order), `(1, seq, n)` when
enqueued fresh, where `n` is the policy's insertion counter (a total order even if two requests
share a `.seq`). Removal flips `entry.alive`; heaps drop dead entries when they reach the top
and compact when more than half of them are dead, so every request operation is O(log n).

Flows: the requests of one tenant and one LoRA adapter (`.lora_name`; None, the base model, is
a flow too) are a *flow*, and a `TenantQueue` keeps one heap per flow. Its head is the requeued
request with the smallest key if it has any; otherwise the head (by key) of the flow whose
counter is smallest, ties by that head's key. Flow counters are the policy's
(policies/flows.py): the tenant's service split by adapter, so the adapters of one tenant share
its service as the tenants share the engine. With a single flow the head is the smallest key,
the order within a tenant described above.

An `Order` is one ordered queue made of per-tenant queues; it chooses which tenant's head goes
next. Orders are internal to a `Policy`: they read the policy's counters, quota state and tenant
registration order, and the policy calls them only through the methods of `Order`.
"""

from __future__ import annotations

from collections.abc import Iterable
from heapq import heapify, heappop, heappush, heapreplace
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request

    from .base import Policy

REQUEUED = 0  # key[0] of a preempted request: ahead of its tenant's fresh ones
FRESH = 1  # key[0] of a new arrival

EntryKey = tuple[int, int, int]  # (REQUEUED | FRESH, req.seq, insertion number)


class Entry:
    """One queued request. Dead (`alive` False) once popped or removed; never revived."""

    __slots__ = ("req", "key", "alive", "order", "tq", "adapter", "flow")

    def __init__(self, req: Request, key: EntryKey, adapter: str | None = None) -> None:
        self.req = req
        self.key = key
        self.alive = True
        self.adapter = adapter  # its flow inside its tenant: `.lora_name` (None: base model)
        self.order: Order | None = None  # the order holding it (a priority class, or the only one)
        self.tq: TenantQueue | None = None  # its tenant's queue inside that order
        self.flow: FlowQueue | None = None  # its adapter's heap inside that tenant queue


class LazyHeap:
    """A min-heap of `(key, entry)` with lazy deletion: kill the entry, then call `discarded()`."""

    __slots__ = ("items", "live")

    def __init__(self) -> None:
        self.items: list[tuple[Any, Entry]] = []
        self.live = 0

    def push(self, key: Any, entry: Entry) -> None:
        heappush(self.items, (key, entry))
        self.live += 1

    def top(self) -> Entry | None:
        """The live entry with the smallest key, dropping dead ones on the way."""
        items = self.items
        while items:
            entry = items[0][1]
            if entry.alive:
                return entry
            heappop(items)
        return None

    def discarded(self) -> None:
        """Account for one killed entry; compact when dead ones dominate (amortized O(1))."""
        self.live -= 1
        if len(self.items) > 2 * self.live + 64:
            self.items = [item for item in self.items if item[1].alive]
            heapify(self.items)


class FlowQueue(LazyHeap):
    """One flow's waiting requests inside a `TenantQueue`, smallest `Entry.key` first."""

    __slots__ = ("adapter",)

    def __init__(self, adapter: str | None) -> None:
        super().__init__()
        self.adapter = adapter


class TenantQueue:
    """One tenant's waiting requests inside one order: a heap per flow (module doc). The flow
    counters are the policy's, which lifts them (policies/flows.py) before an entry is pushed.
    """

    __slots__ = ("name", "ring", "head", "version", "live", "flows", "counters")

    def __init__(self, name: str, ring: int, counters: dict[str | None, float]) -> None:
        self.name = name
        self.ring = ring  # the tenant's registration number (round robin's cycle position)
        self.head: Entry | None = None  # the head as last indexed by a HeadOrder
        self.version = 0  # bumped on re-indexing; older tenant-heap items are stale
        self.live = 0
        self.flows: dict[str | None, FlowQueue] = {}  # adapter -> its heap, while it has entries
        self.counters = counters  # adapter -> flow counter: the policy's, shared by its orders

    @property
    def items(self) -> list[tuple[Any, Entry]]:
        """Every flow heap's items, dead ones included (for inspection)."""
        return [item for flow in self.flows.values() for item in flow.items]

    def push(self, entry: Entry) -> None:
        """Queue `entry` in its flow's heap."""
        flow = self.flows.get(entry.adapter)
        if flow is None:
            flow = self.flows[entry.adapter] = FlowQueue(entry.adapter)
        flow.push(entry.key, entry)
        entry.flow = flow
        self.live += 1

    def discarded(self, entry: Entry) -> None:
        """Account for the killed `entry` (queued here)."""
        flow = entry.flow
        assert flow is not None
        flow.discarded()
        self.live -= 1
        if flow.live == 0:
            del self.flows[flow.adapter]

    def top(self) -> Entry | None:
        """The head: the live entry that `before` puts ahead of all others here."""
        flows = self.flows
        if len(flows) == 1:
            for flow in flows.values():
                return flow.top()
        best: Entry | None = None
        for flow in flows.values():
            entry = flow.top()
            if entry is not None and (best is None or self.before(entry, best)):
                best = entry
        return best

    def before(self, a: Entry, b: Entry) -> bool:
        """Whether `a` goes before `b` (both queued here): requeued first, by key; fresh ones by
        flow counter, then key (within one flow that is key order)."""
        if a.flow is b.flow or a.key[0] != FRESH or b.key[0] != FRESH:
            return a.key < b.key
        assert a.flow is not None and b.flow is not None
        ca, cb = self.counters[a.flow.adapter], self.counters[b.flow.adapter]
        return ca < cb or (ca == cb and a.key < b.key)

    def flow_lead(self, adapter: str | None) -> float:
        """How far the flow's counter is above the lowest of the flows queued here (0.0 for
        that one, and whenever one flow is queued): the flow term of a fresh request's rank."""
        flows = self.flows
        if len(flows) < 2 or adapter not in flows:
            return 0.0
        counters = self.counters
        return counters[adapter] - min(counters[name] for name in flows)


class Order:
    """One ordered queue of entries, split per tenant. Contract for subclasses:

    * `add(entry)` inserts a live entry at its key's place in its tenant's queue.
    * `discard(entry)` / `taken(entry)` account for an entry the policy already killed;
      `taken` is used for the entry `select()` just returned (popped), `discard` otherwise.
    * `select()` returns the entry to serve next among tenants not in `policy._throttled`,
      or None; it removes nothing (it may tidy internal heaps).
    * `rank_key(req, flag)` is the order's sort key for `req` (`flag` = REQUEUED or FRESH);
      the head `select()` returns has the smallest rank_key among eligible queued entries.
    * `eligibility_changed(tenant)` / `counters_reset()` are called after the tenant entered or
      left the throttled set, and after counters were set from outside (they may decrease).
    * `flows_charged(tenant)` is called after the tenant's flow counters grew; it returns
      whether that can change what `select()` answers (only with more than one flow queued).
      `tenant_flows(tenant)` are the tenant's flows queued here (for the flow lift).
    * `changes_on_charge`: whether a `charge()` can change what `select()` answers (a policy
      made of such orders recomputes its peek after every charge).
    """

    changes_on_charge: ClassVar[bool] = False

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._queues: dict[str, TenantQueue] = {}
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def _queue(self, name: str) -> TenantQueue:
        tq = self._queues.get(name)
        if tq is None:
            policy = self._policy
            tq = TenantQueue(name, policy._ring[name], policy._flow_counters_of(name))
            self._queues[name] = tq
        return tq

    def add(self, entry: Entry) -> None:
        raise NotImplementedError

    def discard(self, entry: Entry) -> None:
        raise NotImplementedError

    def taken(self, entry: Entry) -> None:
        self.discard(entry)

    def select(self) -> Entry | None:
        raise NotImplementedError

    def tenant_head(self, tenant: str) -> Entry | None:
        """The entry `tenant`'s queue here serves next, or None (eligibility not checked)."""
        tq = self._queues.get(tenant)
        return tq.top() if tq is not None and tq.live else None

    def rank_key(self, req: Request, flag: int) -> tuple:
        raise NotImplementedError

    def flow_lead(self, req: Request, flag: int) -> float:
        """The flow term of `req`'s rank_key, right after `flag`: for a queued fresh request,
        how far its flow's counter is above the lowest one queued in its tenant; 0.0 for
        requeued ones and with a single flow, so ranks order a tenant's requests as its queue
        does."""
        if flag != FRESH:
            return 0.0
        tq = self._queues.get(req.tenant)
        return 0.0 if tq is None else tq.flow_lead(self._policy._adapter(req))

    def eligibility_changed(self, tenant: str) -> None:
        pass

    def counters_reset(self) -> None:
        pass

    def flows_charged(self, tenant: str) -> bool:
        return False

    def tenant_flows(self, tenant: str) -> Iterable[str | None]:
        """The tenant's flows with requests queued here."""
        tq = self._queues.get(tenant)
        return () if tq is None else tq.flows.keys()

    def _push(self, tq: TenantQueue, entry: Entry) -> None:
        """Push `entry` into `tq`, its flow's counter lifted first if the flow is new here."""
        if entry.adapter not in tq.flows:
            self._policy._flow_arrives(entry)
        tq.push(entry)


class HeadOrder(Order):
    """Serves the eligible tenant whose `tenant_key` is smallest (fcfs, weighted_fair).

    The tenants sit in a heap of `(*tenant_key, version, TenantQueue)` (flat: a comparison
    stops at the first element that differs, without a nested tuple). An item is current only
    while its version equals the queue's; re-indexing pushes a new item and strands the old one.
    A tenant key that only *grew* since it was pushed (weighted_fair: a counter was charged) is
    fixed when it surfaces, so `charge()` costs no heap work; anything that can *lower* a key
    (a new head, counters set from outside, a tenant becoming eligible) re-indexes at once.
    Throttled tenants are dropped from the heap when they surface and re-indexed on wake-up.
    """

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self._heap: list[tuple] = []

    def tenant_key(self, tq: TenantQueue) -> tuple:
        """The key of `tq`'s head for choosing among tenants; tq.head is not None."""
        raise NotImplementedError

    def add(self, entry: Entry) -> None:
        name = entry.req.tenant
        tq = self._queues.get(name) or self._queue(name)
        if tq.live == 0:
            self.backlogging(tq, entry)
        self._push(tq, entry)
        entry.tq = tq
        self._live += 1
        # tq.head is always tq.top() (None when empty): with one flow the smallest key, with
        # several the head by `before`, which the plain key comparison would get wrong.
        head = tq.head
        if head is None or tq.before(entry, head):
            tq.head = entry
            self._index(tq)

    def backlogging(self, tq: TenantQueue, entry: Entry) -> None:
        """Hook: `entry` is about to make the empty `tq` non-empty."""

    def discard(self, entry: Entry) -> None:
        tq = entry.tq
        assert tq is not None
        tq.discarded(entry)
        self._live -= 1
        if entry is tq.head:
            tq.head = tq.top()
            self._index(tq)

    def flows_charged(self, tenant: str) -> bool:
        tq = self._queues.get(tenant)
        if tq is None or len(tq.flows) < 2:
            return False  # one flow: its order is by key whatever its counter
        head = tq.top()
        if head is tq.head:
            return False
        tq.head = head
        self._index(tq)  # its tenant key may have gone down (fcfs): re-index now
        return True

    def select(self) -> Entry | None:
        heap = self._heap
        throttled = self._policy._throttled
        while heap:
            item = heap[0]
            tq = item[-1]
            if item[-2] != tq.version:
                heappop(heap)  # stranded by a re-index
            elif tq.name in throttled:
                heappop(heap)
                tq.version += 1  # out of the heap until eligibility_changed re-indexes it
            else:
                current = self.tenant_key(tq)
                if current == item[:-2]:
                    return tq.head
                tq.version += 1  # the key grew since it was pushed: sink it to its place
                heapreplace(heap, current + (tq.version, tq))
        return None

    def eligibility_changed(self, tenant: str) -> None:
        tq = self._queues.get(tenant)
        if tq is not None:
            self._index(tq)

    def counters_reset(self) -> None:
        self._rebuild()

    def _index(self, tq: TenantQueue) -> None:
        heap = self._heap
        # After a pop the served tenant's item is usually on top: replace it in one sift.
        on_top = bool(heap) and heap[0][-1] is tq and heap[0][-2] == tq.version
        tq.version += 1
        if tq.head is None or tq.name in self._policy._throttled:
            return
        item = self.tenant_key(tq) + (tq.version, tq)
        if on_top:
            heapreplace(heap, item)
        else:
            heappush(heap, item)
            if len(heap) > 2 * len(self._queues) + 64:
                self._rebuild()  # too many stranded items: keep the heap O(tenants)

    def _rebuild(self) -> None:
        throttled = self._policy._throttled
        heap = []
        for tq in self._queues.values():
            if tq.head is not None and tq.name not in throttled:
                heap.append(self.tenant_key(tq) + (tq.version, tq))
        heapify(heap)
        self._heap = heap
