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
                Only a request that waits for a LoRA adapter slot is overtaken, by the first
                request in policy order that needs none (the rule is in `loras.py`).
Step 1 before 2 and 3 means a running request is never starved by admissions; stopping 2 and 3
after a preemption keeps a step from freeing blocks and handing them straight back (thrash) and
keeps a freed GPU block from being both a swap-out source and a swap-in target in one step.

Host tier (kv/host_tier.py): a waiting request's prefix lookup continues from the device into
host memory. Its host hits are loaded into its new blocks this step (`kv_load`, on the copy
stream) and it computes from the next step on, so the load overlaps the others' forward; it is
no preemption victim in the step that loads it. Blocks the device evicted during the step are
kept in the host tier by the `kv_store` copies, which the runner issues first.

Parallel sampling (n > 1 samples of one prompt): see `forks.py`. LoRA adapters (a request
waits until its adapter has a slot, and pins it while running; who may overtake it and why it
cannot starve): see `loras.py`; the adapters of one tenant share its service fairly, by flow
counters the step charges (policies/flows.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from fairbatch.kv.block_pool import KVBlock
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import Policy
from fairbatch.scheduler.charges import StepCharges
from fairbatch.scheduler.config import SchedulerConfig
from fairbatch.scheduler.deadlines import Deadlines
from fairbatch.scheduler.forks import Forks
from fairbatch.scheduler.loras import LoRASlots
from fairbatch.scheduler.output import RunnerOutput, SchedulerOutput, StepUpdates
from fairbatch.scheduler.preemption import preemption_mode, takeable
from fairbatch.scheduler.request import FINISH_REASONS, Request, RequestStatus
from fairbatch.scheduler.seats import KeptSeats


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        policy: Policy,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or policy.clock  # of request deadlines; by default the quotas' one
        self.kv = kv_manager
        self.policy = policy  # the waiting queue and tenant accounting
        if policy.wants_hit_length:
            policy.set_hit_length(self._hit_length)
        kv_shares = policy.kv_shares()
        if kv_shares:  # tenants' kept KV blocks (kv/block_pool.py; preemption.takeable)
            kv_manager.set_kv_shares(kv_shares)
        preempt = config.priority_preemption
        self.priority_preemption = policy.preempts_lower_classes if preempt is None else preempt
        capacity = kv_manager.gpu_pool.num_blocks * kv_manager.block_size
        # A lone request must always fit, or it would preempt itself forever.
        self.max_model_len = min(config.max_model_len, capacity)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._finished_ids: set[str] = set()
        # request id -> times it was preempted, for those that ended preempted at least once
        # (not aborted): the engine puts it on the request's last output (usage records)
        self.ended_preemptions: dict[str, int] = {}
        self._seq = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.num_swapped_blocks = {"out": 0, "in": 0}
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache
        self.num_host_hit_tokens = 0  # ... of which loaded from the host tier
        self.forks = Forks(kv_manager, config.max_num_seqs)
        self.deadlines = Deadlines()
        self.num_timed_out = {"queue": 0, "running": 0}
        self.loras: LoRASlots | None = None  # set by the engine when it serves LoRA adapters
        self.kept_seats = KeptSeats()  # seats the controller gave a preempted one's place to
        self._seat_limit = config.max_num_seqs  # seats for the rest, this step

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
            parent.prompt_token_ids != request.prompt_token_ids
            or parent.tenant != request.tenant
            or parent.lora_name != request.lora_name
        ):
            raise ValueError(
                f"fork_of {fork_of!r} has another prompt or tenant, or another LoRA adapter"
            )
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for at least one new token)"
            )
        self._adopt(request)
        request.status = RequestStatus.WAITING
        self.kv.hash_prompt(request)
        if parent is None:
            self.policy.enqueue(request)
            return
        self.forks.hold(fork_of, request)  # its parent's prefill is to come: it waits for it
        if parent.num_output_tokens:  # done (a parent with output holds no other siblings)
            can_fork = (
                parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens >= parent.num_prompt_tokens
            )
            for sibling in self._release_siblings(parent, can_fork):
                self._start_running(sibling)

    def _adopt(self, request: Request) -> None:
        """Number a new or imported request, cap it at the context limit, watch its deadline."""
        self._seq += 1
        request.seq = self._seq
        request.max_num_tokens = min(
            request.num_prompt_tokens + request.max_tokens, self.max_model_len
        )
        self.requests[request.request_id] = request
        self.deadlines.watch(request)

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
        if self.forks.held:
            self._release_siblings(request, can_fork=False)
        request.status = status
        self.kv.forget(request)
        self.kept_seats.release(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        if request.num_preemptions and status != RequestStatus.FINISHED_ABORTED:
            self.ended_preemptions[request.request_id] = request.num_preemptions

    def _dequeue(self, request: Request) -> None:
        """Take a request that is not running out of its queue (swapped, waiting or held)."""
        if request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.fork_of is not None:
            self.forks.remove(request)
        else:
            self.policy.remove(request)
        if self.loras is not None:
            self.loras.forget(request)

    def _release_siblings(self, parent: Request, can_fork: bool) -> list[Request]:
        """The siblings held for `parent`, forked (returned, for the caller to start) or
        queued; see `Forks.release`."""
        return self.forks.release(parent, can_fork, len(self.running), self.policy.enqueue)

    @property
    def num_forks(self) -> int:
        return self.forks.num_forks

    # ---- deadlines --------------------------------------------------------------------------

    def _evict_expired(self, out: SchedulerOutput) -> None:
        """At a step's start: finish every request past its deadline with "timeout" (which
        ones: `Deadlines.expired`). A running request leaves as any finish does (its full
        blocks enter the prefix cache), charged for the steps it computed; a waiting or
        swapped one never takes a block."""
        for request, stage in self.deadlines.expired(self.clock(), self.requests):
            self._finish(request, RequestStatus.FINISHED_TIMEOUT)
            out.timed_out[request.request_id] = (request.tenant, stage)
            self.num_timed_out[stage] += 1

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv.release_reads()  # the last step's copies were issued
        out = SchedulerOutput(block_tables=self.kv.req_block_ids)
        out.copy_blocks = self.forks.take_copies()
        if self.deadlines.due(self.clock()):
            self._evict_expired(out)
        budget = self.config.max_num_batched_tokens
        kept = bool(self.kept_seats) and self.kept_seats.refresh(self.requests, self.clock())
        budget = self._schedule_running(out, budget, self._kept_reserve(budget) if kept else 0)
        if not out.preempted_swap and not out.preempted_recompute:
            self._seat_limit = self.config.max_num_seqs
            if kept:
                budget = self._schedule_kept(out, budget)
                self._seat_limit -= len(self.kept_seats)
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
        out.kv_store = self.kv.take_stores()
        out.finished_ids, self._finished_ids = self._finished_ids, set()
        return out

    def _add_scheduled(self, out: SchedulerOutput, request: Request, n: int, new_ids) -> None:
        rid = request.request_id
        out.scheduled.append(request)
        out.num_scheduled_tokens[rid] = n
        out.total_num_scheduled_tokens += n
        if new_ids:
            out.new_block_ids[rid] = new_ids

    def _kept_reserve(self, budget: int) -> int:
        """Tokens of the budget kept for the prompts of the requests seats are kept for: what
        is left once every running request has its next token. The controller preempted a
        request so that these start now; behind other requests' prefill chunks they would
        wait a step or more (a step as long as the budget) for nothing."""
        need = sum(
            r.num_tokens - r.num_computed_tokens for r in self.kept_seats.waiting(self.requests)
        )
        if not need:
            return 0
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return min(need, max(0, budget - decodes))

    def _schedule_running(self, out: SchedulerOutput, budget: int, reserve: int = 0) -> int:
        """Each running request in order its next chunk (its tokens not yet computed, within the
        budget; a prefill chunk within the budget less `reserve`). One that finds no blocks
        makes room: the policy picks a victim among the requests not yet scheduled, itself
        included, until it fits or is the victim."""
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(remaining, budget if remaining == 1 else budget - reserve)
            if n <= 0:  # a prefill chunk, and what is left is the kept seats'
                i += 1
                continue
            new_ids = self.kv.allocate_slots(request, n)
            while new_ids is None:
                candidates = takeable(self.kv, running, running[i:], request)
                victim = self.policy.pick_victim(candidates)
                self._preempt(victim, out)
                if victim is request:
                    break
                new_ids = self.kv.allocate_slots(request, n)
            if new_ids is None:
                continue  # it gave way: running[i] is the next one now
            self._add_scheduled(out, request, n, new_ids)
            budget -= n
            i += 1
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        if not self.swapped:
            return budget
        self.swapped.sort(key=self.policy.rank)
        while self.swapped and budget > 0 and len(self.running) < self._seat_limit:
            request = self.swapped[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            blocks_after = self.kv.num_blocks_needed(request.num_computed_tokens + n)
            extra = blocks_after - self.kv.num_swapped_blocks(request)
            if not self.kv.can_swap_in(request, extra):
                break  # keep policy order: no later swapped request jumps this one
            if self.loras is not None and not self.loras.can_resume(request):
                break  # every adapter slot is in use: it waits, as for blocks
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

    def _schedule_kept(self, out: SchedulerOutput, budget: int) -> int:
        """The requests seats are kept for (seats.py), before anyone else, oldest first."""
        for request in self.kept_seats.waiting(self.requests):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.loras is not None and not self.loras.can_start(request):
                continue
            start = self._plan_start(request, budget)
            if start is None or start[1] is None:
                break  # its seat stays kept until it fits
            budget -= self._admit(request, out, *start)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        policy = self.policy
        seats = self._seat_limit
        # A swapped request still out (it found too few blocks or seats) is not overtaken by
        # a waiting one it precedes in policy order: new work must not starve swapped work.
        first_swapped = policy.rank(self.swapped[0]) if self.swapped else None
        request = None  # once chosen, a request keeps its turn while room is made for it
        while budget > 0:
            if request is None:
                if len(self.running) >= seats and not self.priority_preemption:
                    return  # no seat, and nobody may take one
                request = policy.peek()
                if request is not None and self.loras is not None:
                    if not self.loras.can_start(request):  # it waits for an adapter slot
                        request = self._first_startable()
                if request is None:
                    return
                if request.request_id in out.preempted_recompute:
                    return  # a victim of this step waits for the next one (no ping-pong)
                if first_swapped is not None and not policy.rank(request) < first_swapped:
                    return  # the swapped request goes first
            if len(self.running) >= seats:
                if not self._preempt_lower(request, out):
                    return
                budget = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens
                continue
            start = self._plan_start(request, budget)
            if start is None:
                return
            if start[1] is None:
                if not self._preempt_lower(request, out):
                    return  # head-of-line waits: later requests never jump the policy's order
                budget = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens
                continue
            budget -= self._admit(request, out, *start)
            request = None

    def _plan_start(
        self, request: Request, budget: int
    ) -> tuple[int, list[int] | None, int, list[KVBlock]] | None:
        """(tokens to compute, new block ids or None when blocks run short, prompt tokens found
        in the device prefix cache, host-tier blocks to load after them) to start the waiting
        `request` within `budget`; None when the rest of its prompt exceeds the budget and
        chunked prefill is off. The new blocks cover the loaded ones first."""
        if request.prompt_logprobs is not None and request.prompt_logprobs.num_missing:
            # Its prompt's log-probs need every position's logits, which cached blocks
            # never produced: compute the whole prompt (as vLLM does), once.
            computed, num_cached_tokens, host = [], 0, []
        else:
            computed, num_cached_tokens = self.kv.get_computed_blocks(request)
            host = self.kv.get_host_blocks(request, len(computed))
        num_loaded = len(host) * self.kv.block_size
        remaining = request.num_tokens - request.num_computed_tokens - num_cached_tokens
        remaining -= num_loaded
        n = min(remaining, budget)
        if n < remaining and not self.config.enable_chunked_prefill:
            return None
        new_ids = self.kv.allocate_slots(request, num_loaded + n, computed)
        return n, new_ids, num_cached_tokens, host

    def _admit(
        self,
        request: Request,
        out: SchedulerOutput,
        n: int,
        new_ids: list[int],
        num_cached_tokens: int,
        host: list[KVBlock],
    ) -> int:
        """A waiting request starts with `n` tokens on `new_ids` (and its cached prefix), or,
        with host-tier hits, loads them this step and computes from the next. Returns the
        tokens it computes this step."""
        # remove, not pop: a victim requeued ahead of it must not take its place
        self.policy.remove(request, served=True)
        num_loaded = len(host) * self.kv.block_size
        request.num_computed_tokens += num_cached_tokens + num_loaded
        self.num_prefix_hit_tokens += num_cached_tokens + num_loaded
        self.num_host_hit_tokens += num_loaded
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached_tokens + num_loaded
        self._start_running(request)
        self.kept_seats.release(request.request_id)
        if host:
            out.kv_load.extend(self.kv.load(host, new_ids))
            out.loading.append(request.request_id)
            out.new_block_ids[request.request_id] = new_ids
            return 0
        self._add_scheduled(out, request, n, new_ids)
        return n

    def _first_startable(self) -> Request | None:
        """The first waiting request in policy order whose adapter may start now (see
        `LoRASlots.can_start`): the one that overtakes a head whose adapter waits for a slot.
        A scan of the whole queue, done only while some request waits for a slot."""
        policy, loras = self.policy, self.loras
        assert loras is not None
        startable = (r for r in policy if policy.quota_eligible(r.tenant) and loras.can_start(r))
        return min(startable, key=policy.rank, default=None)

    def _hit_length(self, request: Request) -> int:
        """Prompt tokens of a waiting request that admitting it now would take from the prefix
        cache (what `_schedule_waiting` does), for policies that order by it. No side effects."""
        if request.prompt_logprobs is not None and request.prompt_logprobs.num_missing:
            return 0
        return self.kv.num_cached_prefix_tokens(request)

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if self.loras is not None:
            self.loras.start(request)  # pins its adapter's slot while it runs
        # charged one decode token per step from now on (a step it does not sample is a miss)
        self.policy.add_decoding(request.tenant, 1)

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        self.policy.add_decoding(request.tenant, -1)
        if self.loras is not None:
            self.loras.stop(request)

    def _preempt_lower(self, request: Request, out: SchedulerOutput) -> bool:
        """Make room for `request` by preempting a running request of strictly lower priority."""
        if not self.priority_preemption:
            return False
        if not any(r.priority < request.priority for r in self.running):
            return False
        # (not one loading this step: its loads' targets would be given back or swapped out)
        running = [r for r in self.running if r.request_id not in out.loading]
        candidates = takeable(self.kv, self.running, running, request)
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

    def _preempt(self, victim: Request, out: SchedulerOutput, mode: str | None = None) -> None:
        mode = mode or preemption_mode(self.config, self.kv, victim)
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

    # ---- after the forward ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> StepUpdates:
        """Advance progress, append sampled tokens, finish requests, charge tenants (and,
        serving LoRA, their flows: `charges.py`)."""
        sampled = runner_output.sampled_token_ids
        new_tokens = sampled  # copied only if a token must be dropped (below)
        finished: dict[str, str] = {}
        num_scheduled = scheduler_output.num_scheduled_tokens
        bs = self.kv.block_size
        caching = self.kv.enable_prefix_caching
        charges = StepCharges(self.running, sampled, flows=self.loras is not None)
        self.policy.charge_decode_step(charges.missed)
        forked: list[Request] = []  # siblings started on their parent's blocks this step
        for request in scheduler_output.scheduled:
            rid = request.request_id
            if request.status is not RequestStatus.RUNNING:  # aborted or finished since
                if rid in new_tokens:
                    if new_tokens is sampled:
                        new_tokens = dict(sampled)  # the runner's dict stays as it was
                    del new_tokens[rid]
                continue
            n = num_scheduled[rid]
            request.num_computed_tokens += n
            if caching and request.num_computed_tokens % bs < n:  # the chunk filled a block
                self.kv.cache_computed_blocks(request)
            if request.num_prompt_charged < request.num_prompt_tokens:
                charges.prompt(request)
            token = sampled.get(rid)
            if token is None:
                continue  # a prefill chunk that did not reach the prompt's end
            if rid in self.forks.held:  # its prompt is computed: fork them before it may finish
                num_running = len(self.running) + len(forked)
                forked.extend(self.forks.release(request, True, num_running, self.policy.enqueue))
            request.all_token_ids.append(token)
            if token in request.stop_token_ids or request.num_tokens >= request.max_num_tokens:
                finished[rid] = self._finish_on(request, token)
        for sibling in forked:
            self._start_running(sibling)
        charges.charge(self.policy)
        return StepUpdates(new_tokens, finished)

    def _finish_on(self, request: Request, token: int) -> str:
        """Finish a request whose last token is a stop token or reached its length limit."""
        if token in request.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        else:
            status = RequestStatus.FINISHED_LENGTH  # max_tokens or the context limit
        self._finish(request, status)
        return FINISH_REASONS[status]

    # ---- hooks for the cluster controller ---------------------------------------------------

    def preempt(
        self, request_id: str, mode: str = "auto", seat_for: str | None = None
    ) -> SchedulerOutput | None:
        """Preempt a running request between steps. Returns the swap-out copies to issue
        (an output with no scheduled requests), or None if it is not running. Raises
        ValueError, changing nothing, for an unknown mode or for "swap" when the CPU swap
        space cannot hold the request ("auto" picks recompute then). `seat_for`: the request
        its seat is kept for (seats.py), which may arrive before or after this call."""
        if mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"mode must be 'auto', 'swap' or 'recompute', got {mode!r}")
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            if seat_for is not None:  # it ended, or waits: its seat is free, and kept all the same
                self.kept_seats.keep(seat_for, self.clock())
            return None
        if mode == "swap" and not self.kv.can_swap_out(request):
            num_blocks = len(self.kv.block_ids(request_id))
            raise ValueError(
                f"no CPU swap space for {request_id!r}: it holds {num_blocks} blocks, "
                f"{self.kv.cpu_pool.num_free_blocks if self.kv.num_cpu_blocks else 0} are free"
            )
        self.kv.release_reads()
        out = SchedulerOutput(copy_blocks=self.forks.take_copies())  # a fork's copies first
        self._preempt(request, out, None if mode == "auto" else mode)
        out.kv_store = self.kv.take_stores()  # (a fork's copy target may be an evicted block)
        if seat_for is not None:
            self.kept_seats.keep(seat_for, self.clock())
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
        if self.forks.held:
            self._release_siblings(request, can_fork=False)
        self.kv.forget(request)
        del self.requests[request_id]
        return request, cpu_ids

    def import_request(self, request: Request, num_swapped_blocks: int = 0) -> list[int] | None:
        """Adopt a request exported elsewhere. With swapped blocks, returns the CPU block ids to
        fill with its K/V (it resumes by swap-in); otherwise it resumes by recompute."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._adopt(request)
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
        num_held = self.forks.check_integrity(self.requests)
        n = len(self.running) + len(self.swapped) + len(self.policy) + num_held
        assert n == len(self.requests), "a request is in no queue, or in two"
        assert len(self.running) <= self.config.max_num_seqs, "more running than seats"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
        assert self.policy.decode_rates() == Counter(r.tenant for r in self.running)
        for r in self.swapped:
            assert r.status == RequestStatus.SWAPPED
