"""The iteration-level scheduler: which requests compute how many tokens this step.

Each step walks three queues in a fixed order:
  1. running  - requests holding GPU blocks get their next chunk (a decode is a chunk of 1);
                when blocks run out, the policy picks a victim among the requests not yet
                scheduled this step, which is swapped out or dropped for recompute.
  2. swapped  - if nobody was preempted this step, swapped requests come back in policy order.
  3. waiting  - likewise, new and recompute-preempted requests are admitted in policy order; a
                waiting request of strictly higher priority preempts a lower one when seats
                (max_num_seqs) or blocks are what is short.
Step 1 before 2 and 3 means a running request is never starved by admissions; stopping 2 and 3
after a preemption keeps a step from freeing blocks and handing them straight back (thrash) and
keeps a freed GPU block from being both a swap-out source and a swap-in target in one step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from fairbatch.kv.manager import KVCacheManager
from fairbatch.scheduler.config import SchedulerConfig
from fairbatch.scheduler.output import RunnerOutput, SchedulerOutput, StepUpdates
from fairbatch.scheduler.request import FINISH_REASONS, Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, policy) -> None:
        self.config = config
        self.kv = kv_manager
        self.policy = policy  # the waiting queue and tenant accounting (policies.Policy)
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
        self.swapped: list[Request] = []
        self._finished_ids: set[str] = set()
        self._seq = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.num_swapped_blocks = {"out": 0, "in": 0}
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache

    # ---- intake -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
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
        self.requests[request.request_id] = request
        self.policy.enqueue(request)

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
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.policy.remove(request)
        request.status = status
        self.kv.forget(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_tables=self.kv.req_block_ids)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_swap and not out.preempted_recompute:
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
        out.finished_ids, self._finished_ids = self._finished_ids, set()
        return out

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
        # The hot loop (every running request, every step): decodes that stay inside their last
        # block skip the KV manager entirely, and output fields are filled inline.
        i = 0
        running = self.running
        bs = self.kv.block_size
        scheduled = out.scheduled
        num_scheduled = out.num_scheduled_tokens
        total = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            n = len(request.all_token_ids) - computed
            if n > budget:
                n = budget
            if n == 1 and computed % bs:
                new_ids = None  # the slot is in the request's last, partly filled block
            else:
                new_ids = self.kv.allocate_slots(request, n)
                while new_ids is None:
                    # Only requests not yet scheduled this step may give way (or this one).
                    victim = self.policy.pick_victim(running[i:])
                    self._preempt(victim, out)
                    if victim is request:
                        break
                    new_ids = self.kv.allocate_slots(request, n)
                if new_ids is None:
                    continue  # this request was the victim; running[i] is now the next one
                if new_ids:
                    out.new_block_ids[request.request_id] = new_ids
            rid = request.request_id
            scheduled.append(request)
            num_scheduled[rid] = n
            total += n
            budget -= n
            i += 1
        out.total_num_scheduled_tokens += total
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
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, n, new_ids)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        policy = self.policy
        request = None  # once chosen, a request keeps its turn while room is made for it
        while budget > 0:
            if request is None:
                request = policy.peek()
                if request is None:
                    return
                if request.request_id in out.preempted_recompute:
                    return  # a victim of this step waits for the next one (no ping-pong)
            if len(self.running) >= self.config.max_num_seqs:
                if not self._preempt_lower(request, out):
                    return
                budget = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens
                continue
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
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, n, new_ids)
            budget -= n
            request = None

    def _preempt_lower(self, request: Request, out: SchedulerOutput) -> bool:
        """Make room for `request` by preempting a running request of strictly lower priority."""
        if not self.priority_preemption:
            return False
        victim = self.policy.pick_victim(self.running, below_priority=request.priority)
        if victim is None:
            return False
        rid = victim.request_id
        n = out.num_scheduled_tokens.pop(rid, None)
        if n is not None:  # already scheduled this step: take it out of the batch
            out.scheduled.remove(victim)
            out.total_num_scheduled_tokens -= n
            out.new_block_ids.pop(rid, None)
        self._preempt(victim, out)
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput, mode: str | None = None) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        mode = mode or self._preemption_mode(victim)
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
        """Advance progress, append sampled tokens, finish requests, charge tenants."""
        sampled = runner_output.sampled_token_ids
        new_tokens = dict(sampled)
        finished: dict[str, str] = {}
        prefill: dict[str, int] = {}
        decoded: list[str] = []  # the tenant of every sampled token
        num_scheduled = scheduler_output.num_scheduled_tokens
        bs = self.kv.block_size
        caching = self.kv.enable_prefix_caching
        running = RequestStatus.RUNNING
        for request in scheduler_output.scheduled:
            rid = request.request_id
            if request.status is not running:
                new_tokens.pop(rid, None)  # aborted or finished between schedule() and now
                continue
            before = request.num_computed_tokens
            after = request.num_computed_tokens = before + num_scheduled[rid]
            if caching and after // bs != before // bs:
                self.kv.cache_computed_blocks(request)
            charged = request.num_prompt_charged
            if charged < request.num_prompt_tokens:
                new_prompt = min(after, request.num_prompt_tokens)
                if new_prompt > charged:
                    t = request.tenant
                    prefill[t] = prefill.get(t, 0) + new_prompt - charged
                    request.num_prompt_charged = new_prompt
            token = sampled.get(rid)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.output_token_ids.append(token)
            all_ids = request.all_token_ids
            all_ids.append(token)
            decoded.append(request.tenant)
            if token in request.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif len(all_ids) >= request.max_num_tokens:  # max_tokens or the context limit
                status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            self._finish(request, status)
            finished[rid] = FINISH_REASONS[status]
        self.policy.charge_step(prefill, Counter(decoded))
        return StepUpdates(new_tokens, finished)

    # ---- hooks for the cluster controller ---------------------------------------------------

    def preempt(self, request_id: str, mode: str = "auto") -> SchedulerOutput | None:
        """Preempt a running request between steps. Returns the swap-out copies to issue
        (an output with no scheduled requests), or None if it is not running."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return None
        out = SchedulerOutput()
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
            self.swapped.remove(request)
        else:
            self.policy.remove(request)
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
        self.requests[request.request_id] = request
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
        n = len(self.running) + len(self.swapped) + len(self.policy)
        assert n == len(self.requests), "a request is in no queue, or in two"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
        for r in self.swapped:
            assert r.status == RequestStatus.SWAPPED
