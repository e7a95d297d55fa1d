"""The iteration-level scheduler: which requests compute how many tokens this step.

Each step walks three queues in a fixed order:
  1. running  - requests holding GPU blocks get their next chunk (a decode is a chunk of 1);
                when blocks run out, the policy picks a victim among the requests not yet
                scheduled this step, which is swapped out or dropped for recompute.
  2. swapped  - if nobody was preempted this step, swapped requests come back in policy order.
  3. waiting  - likewise, new and recompute-preempted requests are admitted in policy order,
                but none that a swapped request still out precedes in that order (swapped work
                is not starved by new work); a waiting request of strictly higher priority
                preempts a lower one when seats (max_num_seqs) or blocks are what is short.
Step 1 before 2 and 3 means a running request is never starved by admissions; stopping 2 and 3
after a preemption keeps a step from freeing blocks and handing them straight back (thrash) and
keeps a freed GPU block from being both a swap-out source and a swap-in target in one step.

Parallel sampling (n > 1 samples of one prompt): each sample is a request of its own; a sibling
added with `fork_of` (the first sample's id) is held, outside the queues, until that parent's
prefill completes. Then it is forked (`_fork`): it shares the parent's full prompt blocks, gets
a copy of the block holding position L - 1 (L = prompt length), and computes only that last
prompt token itself, which yields its own first logits. Its prompt is charged once, to the
parent. Without a seat or a free block then, or when the parent leaves before its prefill is
done, the sibling is queued as an ordinary request (prefix-cache hits still share blocks).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import islice

from fairbatch.kv.manager import KVCacheManager
from fairbatch.scheduler.config import SchedulerConfig
from fairbatch.scheduler.output import RunnerOutput, SchedulerOutput, StepUpdates
from fairbatch.scheduler.request import FINISH_REASONS, Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        policy,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        # The clock of request deadlines (default: the policy's, which quotas use)
        self.clock = clock or getattr(policy, "_clock", time.monotonic)
        self.kv = kv_manager
        self.policy = policy  # the waiting queue and tenant accounting (policies.Policy)
        if getattr(policy, "wants_hit_length", False):  # dlpm, lpm: order by cache hits
            policy.set_hit_length(self._hit_length)
        kv_shares = policy.kv_shares() if hasattr(policy, "kv_shares") else {}
        if kv_shares:  # tenants' kept KV blocks (kv/block_pool.py; `_takeable` below)
            kv_manager.set_kv_shares(kv_shares)
        self.priority_preemption = (
            config.priority_preemption
            if config.priority_preemption is not None
            else getattr(policy, "name", "") == "priority"
        )
        capacity = kv_manager.gpu_pool.num_blocks * kv_manager.block_size
        # A lone request must always fit, or it would preempt itself forever.
        self.max_model_len = min(config.max_model_len, capacity)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        # Running requests whose next step is not a plain decode (one token into a slot it
        # already holds): prefill chunks still to go, decodes that found no free block for
        # their next token, and anything that entered `running` since the last update. Every
        # other running request is plain, so a step where all of them fit needs no per-request
        # decisions. Ids in `running` order.
        self._attention: dict[str, Request] = {}
        # Blocks that decodes which filled their last block took at the end of an update
        # (request id -> [block id]): the next output's new_block_ids, as they are (a request
        # that stops running before then is taken out, see _stop_running).
        self._appended: dict[str, list[int]] = {}
        # The ids of `running` in order, each mapped to 1 (a plain decode's tokens): the
        # num_scheduled_tokens of a step where all of them run, but for `_attention`'s.
        self._running_ids: dict[str, int] = {}
        # running requests per priority: spares priority preemption a scan when none is lower
        self._running_priorities: Counter[int] = Counter()
        # stop token -> running requests that stop on it: a step whose sampled tokens include
        # none of these finishes no request by a stop token (one C-speed check per step)
        self._stop_tokens: dict[int, int] = {}
        self.swapped: list[Request] = []
        # the highest .priority of any request added: when every running request has it, no
        # waiting request can preempt one for its seat
        self._max_priority = -math.inf
        self._finished_ids: set[str] = set()
        # When a waiting request of a class above every running (and swapped) one is next, the
        # step admits that class's requests alone: the running ones skip one step (uncharged)
        # and the newcomer's first token does not wait on their decodes. Pays where a step's
        # time grows with its decodes (a model on the CPU); EngineCore.yield_steps turns it on.
        self.urgent_alone = False
        self.num_alone_steps = 0
        self._seq = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.num_swapped_blocks = {"out": 0, "in": 0}
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache
        # sibling samples waiting for their parent's prefill: parent id -> siblings
        self._held: dict[str, list[Request]] = {}
        self._copies: list[tuple[int, int]] = []  # forks' block copies, for the next output
        self.num_forks = 0  # siblings started on their parent's blocks
        # requests with a finite deadline: a heap of (time, n, request), stale entries skipped
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_n = itertools.count()
        self.num_timed_out = {"queue": 0, "running": 0}

    # ---- intake -----------------------------------------------------------------------------

    def add_request(self, request: Request, fork_of: str | None = None) -> None:
        """Queue a new request. With `fork_of` (the id of another sample of the same prompt and
        tenant) it is a sibling sample: it starts on that parent's prompt blocks once the
        parent's prefill is done, or at once if it is. A parent no longer here makes it an
        ordinary request (output is the same either way)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        parent = None if fork_of is None else self.requests.get(fork_of)
        if parent is not None and (
            parent.prompt_token_ids != request.prompt_token_ids or parent.tenant != request.tenant
        ):
            raise ValueError(f"fork_of {fork_of!r} has another prompt or tenant")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for at least one new token)"
            )
        self._seq += 1
        request.seq = self._seq
        request.max_num_tokens = min(
            request.num_prompt_tokens + request.max_tokens, self.max_model_len
        )
        request.status = RequestStatus.WAITING
        self._max_priority = max(self._max_priority, request.priority)
        self.kv.hash_prompt(request)
        self.requests[request.request_id] = request
        self._watch_deadline(request)
        if parent is None:
            self.policy.enqueue(request)
        elif not parent.num_output_tokens:
            request.fork_of = fork_of  # its prefill is to come: wait for it
            self._held.setdefault(fork_of, []).append(request)
        else:  # (a parent with output holds no siblings: they left at its first token)
            self._held[fork_of] = [request]
            can_fork = (
                parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens >= parent.num_prompt_tokens
            )
            for sibling in self._release_siblings(parent, can_fork):
                self._start_running(sibling)

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is; False if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish from outside (the engine matched a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self._stop_running(request)
        else:
            self._dequeue(request)
        if self._held:
            self._release_siblings(request, can_fork=False)
        request.status = status
        self.kv.forget(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    def _dequeue(self, request: Request) -> None:
        """Take a request that is not running out of its queue (swapped, waiting or held)."""
        if request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.fork_of is not None:
            siblings = self._held[request.fork_of]
            siblings.remove(request)
            if not siblings:
                del self._held[request.fork_of]
            request.fork_of = None
        else:
            self.policy.remove(request)

    # ---- deadlines --------------------------------------------------------------------------

    def _watch_deadline(self, request: Request) -> None:
        when = min(request.deadline, request.queue_deadline)
        if when != math.inf:
            heapq.heappush(self._deadlines, (when, next(self._deadline_n), request))

    def _evict_expired(self, out: SchedulerOutput) -> None:
        """At a step's start: finish every request past its deadline with "timeout". The queue
        deadline holds until a request is first scheduled; the total deadline always. A
        running request leaves as any finish does (its full blocks enter the prefix cache),
        charged for the steps it computed; a waiting or swapped one never takes a block."""
        now = self.clock()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            rid = request.request_id
            if self.requests.get(rid) is not request:
                continue  # finished, or moved to another replica
            started = (
                request.status == RequestStatus.RUNNING
                or request.num_cached_tokens is not None  # scheduled once (or forked)
                or request.num_output_tokens > 0  # resubmitted with its tokens so far
            )
            if now < request.deadline and (started or now < request.queue_deadline):
                # it started before its queue deadline: only the total deadline is left
                if request.deadline != math.inf:
                    heapq.heappush(heap, (request.deadline, next(self._deadline_n), request))
                continue
            stage = "running" if request.num_output_tokens else "queue"  # before a token
            self._finish(request, RequestStatus.FINISHED_TIMEOUT)
            out.timed_out[rid] = (request.tenant, stage)
            self.num_timed_out[stage] += 1

    # ---- parallel sampling: siblings forked from their parent's prompt blocks ---------------

    def _release_siblings(
        self, parent: Request, can_fork: bool, num_starting: int = 0
    ) -> list[Request]:
        """Release the siblings held for `parent`: forked from its blocks if `can_fork` (its
        prompt is computed) and room allows, else queued as ordinary requests. Each inherits
        the prompt tokens charged to the parent, so the tenant pays for the prompt once.
        Returns the forked ones, for the caller to start running (`num_starting`: others
        the caller will start too, which take seats)."""
        forked: list[Request] = []
        for sibling in self._held.pop(parent.request_id, ()):
            sibling.fork_of = None
            sibling.num_prompt_charged = parent.num_prompt_charged
            num_running = len(self.running) + num_starting + len(forked)
            if can_fork and self._fork(parent, sibling, num_running):
                forked.append(sibling)
            else:
                self.policy.enqueue(sibling)
        return forked

    def _fork(self, parent: Request, sibling: Request, num_running: int) -> bool:
        """Start `sibling` on its parent's prompt blocks (the parent's prompt is computed):
        positions < L - 1 shared or copied, the last prompt token left for it to compute, so
        that its step yields its own first logits. False (nothing changed) without a seat, a
        free block for the copy, or the prompt log-probs it asks for."""
        if num_running >= self.config.max_num_seqs:
            return False
        plp = sibling.prompt_logprobs
        if plp is not None and plp.num_missing:
            src = parent.prompt_logprobs
            if src is None or src.num_missing or src.top != plp.top:
                return False  # it computes its prompt itself
        num_tokens = sibling.num_prompt_tokens - 1
        copies = self.kv.fork(parent, sibling, num_tokens)
        if copies is None:
            return False
        if plp is not None and plp.num_missing:
            plp.entries = list(parent.prompt_logprobs.entries)
            plp.num_missing = 0
        self._copies.extend(copies)
        sibling.num_computed_tokens = num_tokens
        sibling.num_cached_tokens = parent.num_cached_tokens
        self.num_forks += 1
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_tables=self.kv.req_block_ids, new_block_ids=self._appended)
        self._appended = {}
        if self._copies:
            out.copy_blocks, self._copies = self._copies, []
        if self._deadlines and self._deadlines[0][0] <= self.clock():
            self._evict_expired(out)
        budget = self.config.max_num_batched_tokens
        urgent = self._urgent_class() if self.urgent_alone else None
        if urgent is not None:  # that class's prefills alone; the rest from the next step on
            self._schedule_waiting(out, budget, urgent)
            self.num_alone_steps += bool(out.scheduled)
        if not out.scheduled:  # (none, or it could not start: an ordinary step)
            budget = self._schedule_running(out, budget)
            if not out.preempted_swap and not out.preempted_recompute:
                budget = self._schedule_swapped(out, budget)
                self._schedule_waiting(out, budget)
        out.all_running_scheduled = len(out.scheduled) == len(self.running)
        out.finished_ids, self._finished_ids = self._finished_ids, set()
        return out

    def _urgent_class(self) -> int | None:
        """The class of the waiting request that goes next, when it is above every running
        and swapped request's (`urgent_alone`); else None."""
        running = self.max_running_priority
        if self._max_priority <= running or not len(self.policy):
            return None  # (no request above the running ones was ever added, or none waits)
        request = self.policy.peek()
        if request is None or request.priority <= running:
            return None
        if any(r.priority >= request.priority for r in self.swapped):
            return None
        return request.priority

    def _chunk(self, request: Request, budget: int) -> int:
        return min(request.num_tokens - request.num_computed_tokens, budget)

    def _add_scheduled(self, out: SchedulerOutput, request: Request, n: int, new_ids) -> None:
        rid = request.request_id
        out.scheduled.append(request)
        out.num_scheduled_tokens[rid] = n
        out.total_num_scheduled_tokens += n
        if new_ids:
            out.new_block_ids[rid] = new_ids

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if self._schedule_all_running(out, budget):
            return budget - out.total_num_scheduled_tokens
        return self._schedule_running_in_order(out, budget)

    def _schedule_all_running(self, out: SchedulerOutput, budget: int) -> bool:
        """The common step: every running request fits in the budget and the free blocks.

        Then each plain decode computes one token and only the requests in `_attention` need a
        look, so the step costs O(attention) Python work plus C-speed list and dict building.
        The result is the one `_schedule_running_in_order` would produce (same chunks, same
        allocation order, same dict order); returns False, changing nothing, if not everyone
        fits.
        """
        running = self.running
        attention = self._attention
        chunks = [len(r.all_token_ids) - r.num_computed_tokens for r in attention.values()]
        num_tokens = len(running) - len(attention) + sum(chunks)  # plain decodes: one each
        if num_tokens > budget:
            return False
        num_scheduled = self._running_ids.copy()
        if attention:  # (in most steps every running request is a plain decode)
            new_ids = self.kv.allocate_slots_batch(attention.values(), chunks)
            if new_ids is None:
                return False
            new_block_ids = out.new_block_ids
            for rid, n, ids in zip(attention, chunks, new_ids):
                num_scheduled[rid] = n
                if ids:
                    new_block_ids[rid] = ids
        out.scheduled = running[:]
        out.num_scheduled_tokens = num_scheduled
        out.total_num_scheduled_tokens = num_tokens
        return True

    def _schedule_running_in_order(self, out: SchedulerOutput, budget: int) -> int:
        # The requests scheduled here are always a prefix of `running` (victims come from the
        # unscheduled rest), so the loop only fills num_scheduled_tokens and `scheduled` is one
        # slice at the end. A plain decode (its slot is there) skips the KV manager entirely.
        running = self.running
        kv = self.kv
        num_scheduled = out.num_scheduled_tokens  # empty: len() = running requests scheduled
        new_block_ids = out.new_block_ids
        start_budget = budget
        while budget > 0:
            request = None
            for request in islice(running, len(num_scheduled), None):
                if budget <= 0:
                    break
                n = len(request.all_token_ids) - request.num_computed_tokens
                if not request.plain_decode:
                    if n > budget:
                        n = budget
                    new_ids = kv.allocate_slots(request, n)
                    if new_ids is None:
                        break  # out of blocks: make room below, then go on from here
                    if new_ids:
                        new_block_ids[request.request_id] = new_ids
                num_scheduled[request.request_id] = n
                budget -= n
            else:
                break  # every running request is scheduled
            if budget <= 0:
                break
            # `request` did not fit: only requests not yet scheduled may give way (or itself)
            while True:
                victim = self.policy.pick_victim(
                    self._takeable(running[len(num_scheduled) :], request)
                )
                self._preempt(victim, out)
                if victim is request:
                    break
                new_ids = kv.allocate_slots(request, n)
                if new_ids is not None:
                    if new_ids:
                        new_block_ids[request.request_id] = new_ids
                    num_scheduled[request.request_id] = n
                    budget -= n
                    break
        out.scheduled = running[: len(num_scheduled)]
        out.total_num_scheduled_tokens = start_budget - budget
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        if not self.swapped:
            return budget
        self.swapped.sort(key=self.policy.rank)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            n = self._chunk(request, budget)
            blocks_after = self.kv.num_blocks_needed(request.num_computed_tokens + n)
            extra = blocks_after - self.kv.num_swapped_blocks(request)
            if not self.kv.can_swap_in(request, extra):
                break  # keep policy order: no later swapped request jumps this one
            self.swapped.pop(0)
            mapping = self.kv.swap_in(request)
            out.swap_in.extend(mapping)
            self.num_swapped_blocks["in"] += len(mapping)
            new_ids = self.kv.allocate_slots(request, n)
            assert new_ids is not None  # checked by can_swap_in above
            self._start_running(request)
            self._add_scheduled(out, request, n, new_ids)
            budget -= n
        return budget

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, floor: int | None = None
    ) -> None:
        policy = self.policy
        # A swapped request still out (it found too few blocks or seats) is not overtaken by
        # a waiting one it precedes in policy order: new work must not starve swapped work.
        first_swapped = policy.rank(self.swapped[0]) if self.swapped else None
        request = None  # once chosen, a request keeps its turn while room is made for it
        while budget > 0:
            if len(self.running) >= self.config.max_num_seqs and (
                not self.priority_preemption or not self._num_running_below(self._max_priority)
            ):
                return  # no seat, and nobody may take one: spare the policy its peek
            if request is None:
                request = policy.peek()
                if request is None:
                    return
                if request.request_id in out.preempted_recompute:
                    return  # a victim of this step waits for the next one (no ping-pong)
                if floor is not None and request.priority < floor:
                    return
                if first_swapped is not None and not policy.rank(request) < first_swapped:
                    return  # the swapped request goes first
            if len(self.running) >= self.config.max_num_seqs:
                if not self._preempt_lower(request, out):
                    return
                budget = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens
                continue
            if request.prompt_logprobs is not None and request.prompt_logprobs.num_missing:
                # Its prompt's log-probs need every position's logits, which cached blocks
                # never produced: compute the whole prompt (as vLLM does), once.
                computed, num_cached_tokens = [], 0
            else:
                computed, num_cached_tokens = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - request.num_computed_tokens - num_cached_tokens
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                return
            new_ids = self.kv.allocate_slots(request, n, computed)
            if new_ids is None:
                if not self._preempt_lower(request, out):
                    return  # head-of-line waits: later requests never jump the policy's order
                budget = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens
                continue
            # remove, not pop: a victim requeued ahead of it must not take its place
            policy.remove(request, served=True)
            request.num_computed_tokens += num_cached_tokens
            self.num_prefix_hit_tokens += num_cached_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached_tokens
            self._start_running(request)
            self._add_scheduled(out, request, n, new_ids)
            budget -= n
            request = None

    def _hit_length(self, request: Request) -> int:
        """Prompt tokens of a waiting request that admitting it now would take from the prefix
        cache (what `_schedule_waiting` does), for policies that order by it. No side effects."""
        if request.prompt_logprobs is not None and request.prompt_logprobs.num_missing:
            return 0
        return self.kv.num_cached_prefix_tokens(request)

    def _start_running(self, request: Request) -> None:
        rid = request.request_id
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._attention[rid] = request  # until an update says what its next step is
        self._running_ids[rid] = 1
        self._running_priorities[request.priority] += 1
        stops = self._stop_tokens
        for token in request.stop_token_ids:
            stops[token] = stops.get(token, 0) + 1
        # charged one decode token per step from now on (a step it does not sample is a miss)
        self.policy.add_decoding(request.tenant, 1)

    @property
    def max_running_priority(self) -> int:
        """The highest priority among the running requests (0 with none running)."""
        return max(self._running_priorities, default=0)

    def _num_running_below(self, priority: int) -> int:
        return sum(n for p, n in self._running_priorities.items() if p < priority)

    def _stop_running(self, request: Request) -> None:
        rid = request.request_id
        self.running.remove(request)
        self._attention.pop(rid, None)
        del self._running_ids[rid]
        priorities = self._running_priorities
        priorities[request.priority] -= 1
        if not priorities[request.priority]:
            del priorities[request.priority]
        stops = self._stop_tokens
        for token in request.stop_token_ids:
            stops[token] -= 1
            if not stops[token]:
                del stops[token]
        self.policy.add_decoding(request.tenant, -1)
        request.plain_decode = False
        self._appended.pop(rid, None)  # not reported: the request gave its blocks back

    def _preempt_lower(self, request: Request, out: SchedulerOutput) -> bool:
        """Make room for `request` by preempting a running request of strictly lower priority."""
        if not self.priority_preemption or not self._num_running_below(request.priority):
            return False
        candidates = self._takeable(self.running, request)
        victim = self.policy.pick_victim(candidates, below_priority=request.priority)
        if victim is None:
            return False
        rid = victim.request_id
        n = out.num_scheduled_tokens.pop(rid, None)
        if n is not None:  # already scheduled this step: take it out of the batch
            out.scheduled.remove(victim)
            out.total_num_scheduled_tokens -= n
        self._preempt(victim, out)  # (which drops its new_block_ids)
        return True

    def _takeable(self, running: list[Request], request: Request) -> list[Request]:
        """The requests of `running` that may give way to `request`: with KV shares, another
        tenant's request only if its tenant keeps at least its reserved blocks without it
        (distinct GPU blocks of its running requests). `request` itself always may."""
        kv = self.kv
        if not kv.gpu_pool.reserves:
            return running
        held: dict[str, set[int]] = {}
        for r in self.running:
            held.setdefault(r.tenant, set()).update(kv.block_ids(r.request_id))
        out = []
        for r in running:
            if r.tenant != request.tenant and kv.reserve(r.tenant):
                rest = held[r.tenant].difference(kv.block_ids(r.request_id))
                if len(rest) < kv.reserve(r.tenant):
                    continue
            out.append(r)
        return out

    def _preempt(self, victim: Request, out: SchedulerOutput, mode: str | None = None) -> None:
        mode = mode or self._preemption_mode(victim)
        self._stop_running(victim)
        out.new_block_ids.pop(victim.request_id, None)  # given back, or swapped out
        victim.num_preemptions += 1
        if mode == "swap":
            mapping = self.kv.swap_out(victim)
            out.swap_out.extend(mapping)
            out.preempted_swap.append(victim.request_id)
            self.num_swapped_blocks["out"] += len(mapping)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            out.preempted_recompute.append(victim.request_id)
            victim.status = RequestStatus.WAITING
            self.policy.requeue(victim)
        self.num_preemptions[mode] += 1

    def _preemption_mode(self, victim: Request) -> str:
        cfg = self.config
        can_swap = self.kv.can_swap_out(victim)
        if cfg.preemption_mode == "recompute" or not can_swap:
            return "recompute"
        if cfg.preemption_mode == "swap":
            return "swap"
        num_blocks = len(self.kv.block_ids(victim.request_id))
        swap_bytes = 2 * num_blocks * self.kv.block_size * cfg.kv_bytes_per_token
        swap_s = swap_bytes / cfg.swap_bandwidth
        recompute_s = victim.num_computed_tokens / cfg.prefill_tokens_per_s
        return "swap" if swap_s < recompute_s else "recompute"

    # ---- after the forward ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> StepUpdates:
        """Advance progress, append sampled tokens, finish requests, charge tenants.

        Tenants are charged by rate: every running request one decode token (the policy counts
        the step, see `Policy.charge_decode_step`) less the ones that sampled nothing, plus
        the prompt tokens computed for the first time.
        """
        sampled = runner_output.sampled_token_ids
        new_tokens = sampled  # copied only if a token must be dropped (below)
        finished: dict[str, str] = {}
        prefill: dict[str, int] = {}
        num_scheduled = scheduler_output.num_scheduled_tokens
        bs = self.kv.block_size
        caching = self.kv.enable_prefix_caching
        running = RequestStatus.RUNNING
        # Running requests that were not scheduled keep their place in `_attention` (they are
        # behind the scheduled ones in `running`; the order is restored below if not).
        attention = {
            rid: r
            for rid, r in self._attention.items()
            if rid not in num_scheduled and r.status is running
        }
        num_carried = len(attention)
        self.policy.charge_decode_step(self._missed(scheduler_output, sampled))
        stops = self._stop_tokens
        if stops and not stops.keys().isdisjoint(new_tokens.values()):
            self._stop_candidates(sampled)
        filled: list[Request] = []  # plain decodes whose last block is full, in batch order
        held = self._held
        forked: list[Request] = []  # siblings started on their parent's blocks this step
        for request in scheduler_output.scheduled:
            if request.plain_decode:  # the common case, kept short: see _attention
                token = sampled[request.request_id]  # a plain decode always samples
                computed = request.num_computed_tokens = request.num_computed_tokens + 1
                request.all_token_ids.append(token)  # now num_tokens == computed + 1
                if computed != request.decode_event:
                    continue  # mid-block, short of its limit, no stop token: nothing to do
                if token in request.stop_token_ids or computed >= request.max_num_tokens - 1:
                    finished[request.request_id] = self._finish_on(request, token)
                elif computed % bs:  # a stop-token candidate that is not its stop token
                    request.decode_event = self._next_decode_event(request)
                else:  # its last block is full: the next token needs a new one (below)
                    filled.append(request)
                continue
            rid = request.request_id
            if request.status is not running:  # aborted or finished since schedule()
                if rid in new_tokens:
                    if new_tokens is sampled:
                        new_tokens = dict(sampled)  # the runner's dict stays as it was
                    del new_tokens[rid]
                continue
            n = num_scheduled[rid]
            after = request.num_computed_tokens + n
            request.num_computed_tokens = after
            in_block = after % bs  # 0: the next token starts a new block
            if in_block < n and caching:  # the chunk filled a block
                self.kv.cache_computed_blocks(request)
            if request.num_prompt_charged < request.num_prompt_tokens:
                self._charge_prompt(request, after, prefill)
            token = sampled.get(rid)
            if token is None:
                attention[rid] = request  # a prefill chunk that did not reach the prompt's end
                continue
            if rid in held:  # its prompt is computed: fork its siblings before it may finish
                forked.extend(self._release_siblings(request, True, len(forked)))
            all_ids = request.all_token_ids
            all_ids.append(token)
            if token in request.stop_token_ids or len(all_ids) >= request.max_num_tokens:
                finished[rid] = self._finish_on(request, token)
            else:  # a plain decode from now on
                request.plain_decode = True
                if in_block:
                    request.decode_event = self._next_decode_event(request)
                else:  # its chunk filled its last block: the next one comes as for decodes
                    filled.append(request)
        if num_carried and len(attention) > num_carried:
            # An unscheduled request went in first, but a scheduled one that still needs a look
            # is ahead of it in `running` (a sibling forked behind a prefill): restore the order.
            attention = {r.request_id: r for r in self.running if r.request_id in attention}
        self._attention = attention
        if filled:
            self._next_blocks(filled)
        for sibling in forked:
            self._start_running(sibling)
        if prefill:
            self.policy.charge_step(prefill, {})
        return StepUpdates(new_tokens, finished)

    def _next_blocks(self, filled: list[Request]) -> None:
        """Plain decodes that filled their last block get the block for their next token now,
        all in one call (it goes out in the next step's new_block_ids); those that find none
        free leave it to schedule(), which finds one or preempts. The full blocks enter the
        prefix cache when the request frees its blocks (KVCacheManager.free, one call for all
        it filled): no prompt is likely to repeat a running request's newest output before."""
        new_blocks = self.kv.append_blocks(filled)
        appended = self._appended
        bs = self.kv.block_size
        for request, block in zip(filled, new_blocks):
            appended[request.request_id] = [block.block_id]
            # _next_decode_event of a request whose last block is full, inline (the call
            # would be ~1.5% of a step; check_integrity asserts the two agree)
            request.decode_event = min(request.num_computed_tokens + bs, request.max_num_tokens - 1)
        if len(new_blocks) < len(filled):
            for request in filled[len(new_blocks) :]:
                request.plain_decode = False
            self._attention = {
                r.request_id: r for r in self.running if not r.plain_decode
            }  # in running order, as `_attention` always is

    def _next_decode_event(self, request: Request) -> int:
        """The num_computed_tokens at which a plain decode next needs a look: its last block
        fills, or it reaches its length limit (stop tokens: see `_stop_candidates`)."""
        computed = request.num_computed_tokens
        return min(
            computed - computed % self.kv.block_size + self.kv.block_size,
            request.max_num_tokens - 1,
        )

    def _stop_candidates(self, sampled: dict[str, int]) -> None:
        """Some sampled token is a running request's stop token: each plain decode that sampled
        such a token gets its look this step (`decode_event` due), where the check is exact."""
        stops, requests = self._stop_tokens, self.requests
        for rid, token in sampled.items():
            if token in stops:
                request = requests.get(rid)
                if request is not None and request.plain_decode:
                    request.decode_event = request.num_computed_tokens + 1

    def _missed(self, out: SchedulerOutput, sampled: dict[str, int]) -> dict[str, int]:
        """Per tenant, the running requests that sampled no token this step: the policy charges
        every running request one decode token per step (`add_decoding`) less these. Only
        requests in `_attention` can be short of a token when all of `running` was scheduled;
        otherwise also the plain decodes that did not fit."""
        missed: dict[str, int] = {}
        for rid, request in self._attention.items():
            if rid not in sampled:
                missed[request.tenant] = missed.get(request.tenant, 0) + 1
        if not out.all_running_scheduled:
            num_scheduled = out.num_scheduled_tokens
            for request in self.running:
                if request.plain_decode and request.request_id not in num_scheduled:
                    missed[request.tenant] = missed.get(request.tenant, 0) + 1
        return missed

    def _finish_on(self, request: Request, token: int) -> str:
        """Finish a request whose last token is a stop token or reached its length limit."""
        if token in request.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        else:
            status = RequestStatus.FINISHED_LENGTH  # max_tokens or the context limit
        self._finish(request, status)
        return FINISH_REASONS[status]

    @staticmethod
    def _charge_prompt(request: Request, num_computed: int, prefill: dict[str, int]) -> None:
        """Add the prompt tokens computed for the first time to the tenant's prefill count
        (recompute after a preemption is not the tenant's doing and is not charged again)."""
        new_prompt = min(num_computed, request.num_prompt_tokens)
        charged = request.num_prompt_charged
        if new_prompt > charged:
            t = request.tenant
            prefill[t] = prefill.get(t, 0) + new_prompt - charged
            request.num_prompt_charged = new_prompt

    # ---- hooks for the cluster controller ---------------------------------------------------

    def preempt(self, request_id: str, mode: str = "auto") -> SchedulerOutput | None:
        """Preempt a running request between steps. Returns the swap-out copies to issue
        (an output with no scheduled requests), or None if it is not running. Raises
        ValueError, changing nothing, for an unknown mode or for "swap" when the CPU swap
        space cannot hold the request ("auto" picks recompute then)."""
        if mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"mode must be 'auto', 'swap' or 'recompute', got {mode!r}")
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return None
        if mode == "swap" and not self.kv.can_swap_out(request):
            num_blocks = len(self.kv.block_ids(request_id))
            raise ValueError(
                f"no CPU swap space for {request_id!r}: it holds {num_blocks} blocks, "
                f"{self.kv.cpu_pool.num_free_blocks if self.kv.num_cpu_blocks else 0} are free"
            )
        out = SchedulerOutput(copy_blocks=self._copies)  # a fork's copies come first
        self._copies = []
        self._preempt(request, out, None if mode == "auto" else mode)
        return out

    def export_request(self, request_id: str) -> tuple[Request, list[int] | None]:
        """Take a waiting or swapped request out of this scheduler to move it elsewhere.

        Returns the request (its tokens, progress and params) and, when swapped, the CPU block
        ids that hold its K/V. Those blocks are released at once: the caller must read them
        before the next step issues copies.
        """
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request {request_id!r}")
        if request.status == RequestStatus.RUNNING:
            raise ValueError(f"{request_id!r} is running; preempt it before exporting")
        cpu_ids = None
        if request.status == RequestStatus.SWAPPED:
            cpu_ids = self.kv.export_swapped(request)
        self._dequeue(request)
        if self._held:
            self._release_siblings(request, can_fork=False)
        self.kv.forget(request)
        del self.requests[request_id]
        return request, cpu_ids

    def import_request(self, request: Request, num_swapped_blocks: int = 0) -> list[int] | None:
        """Adopt a request exported elsewhere. With swapped blocks, returns the CPU block ids to
        fill with its K/V (it resumes by swap-in); otherwise it resumes by recompute."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._seq += 1
        request.seq = self._seq
        request.max_num_tokens = min(
            request.num_prompt_tokens + request.max_tokens, self.max_model_len
        )
        self._max_priority = max(self._max_priority, request.priority)
        self.requests[request.request_id] = request
        self._watch_deadline(request)
        if num_swapped_blocks:
            cpu_ids = self.kv.import_swapped(request, num_swapped_blocks)
            if cpu_ids is not None:
                request.status = RequestStatus.SWAPPED
                self.swapped.append(request)
                return cpu_ids
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.policy.requeue(request)
        return None

    def set_tenant_counters(self, counters: dict[str, float]) -> None:
        self.policy.set_counters(counters)

    # ---- introspection ----------------------------------------------------------------------

    def iter_requests(self) -> Iterable[Request]:
        return self.requests.values()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        num_held = sum(len(siblings) for siblings in self._held.values())
        n = len(self.running) + len(self.swapped) + len(self.policy) + num_held
        assert n == len(self.requests), "a request is in no queue, or in two"
        for parent_id, siblings in self._held.items():
            assert parent_id in self.requests, f"siblings held for {parent_id!r}, which left"
            assert all(s.fork_of == parent_id for s in siblings), "a held sibling lost its parent"
        assert len(self.running) <= self.config.max_num_seqs, "more running than seats"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
        assert list(self._running_ids) == [r.request_id for r in self.running]
        assert self.policy.decode_rates() == Counter(r.tenant for r in self.running)
        assert self._running_priorities == Counter(r.priority for r in self.running)
        stops = Counter(t for r in self.running for t in r.stop_token_ids)
        assert self._stop_tokens == stops, "stop-token counts disagree with running"
        in_order = [r.request_id for r in self.running if r.request_id in self._attention]
        assert in_order == list(self._attention), "attention is not running requests in order"
        bs = self.kv.block_size
        for r in self.running:
            assert r.plain_decode == (r.request_id not in self._attention)
            if r.plain_decode:  # one token into a slot it holds
                assert r.num_tokens - r.num_computed_tokens == 1, f"{r} is not a plain decode"
                num_slots = len(self.kv.block_ids(r.request_id)) * bs
                assert num_slots > r.num_computed_tokens, f"{r} has no slot for its next token"
                assert r.decode_event == self._next_decode_event(r), f"{r} event misplaced"
        for r in self.swapped:
            assert r.status == RequestStatus.SWAPPED
