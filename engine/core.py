"""EngineCore: one replica's step loop - schedule, swap copies + forward + sample, update.

The engine adds what the scheduler does not know about: text (tokenization, incremental
detokenization, stop strings), sampling parameters, and the K/V bytes behind the scheduler's
block ids when a request moves between replicas.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fairbatch.engine.detokenizer import IncrementalDetokenizer
from fairbatch.engine.outputs import RequestDelta
from fairbatch.engine.sampling_params import LoRARequest, SamplingParams
from fairbatch.engine.structured import StructuredOutput
from fairbatch.scheduler import Request, RequestStatus, Scheduler
from fairbatch.scheduler.request import PromptLogprobs


@dataclass
class MigratedRequest:
    """A request in transit between replicas (picklable; K/V as numpy when it was swapped)."""

    request: Request
    kv_blocks: Any = None  # np.ndarray [layers, 2, n, block_size, kv_heads, head_dim] or None
    extra: dict = field(default_factory=dict)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Any,  # ModelRunner, SimRunner or FakeRunner: execute(SchedulerOutput)
        tokenizer: Any = None,
        eos_token_ids: tuple[int, ...] = (),
        vocab_size: int | None = None,  # the logits' width (default: the tokenizer's)
        salt_rule: Callable[[int, str], str] | None = None,  # CausalLM.cache_salt_rule
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or getattr(tokenizer, "vocab_size", None)
        self.eos_token_ids = tuple(eos_token_ids)
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        # requests whose first delta (prompt logprobs, cached tokens) is still to come
        self._first: dict[str, Request] = {}
        self._ids = itertools.count()
        # constrained decoding (grammars, held requests, matchers): built on first use
        self.structured: StructuredOutput | None = None
        # requests evicted past a deadline, per (tenant, stage "queue" | "running")
        self.timed_out: Counter[tuple[str, str]] = Counter()
        self._retiring_loras: set[str] = set()  # adapters no longer served, still in use here
        # the model's prefix-cache salt of a sequence by its length (see `_resalt`), or None
        self.salt_rule = salt_rule

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str = "default",
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        fork_of: str | None = None,
        deadlines: tuple[float | None, float | None] | None = None,
        lora: Any = None,
    ) -> Request:
        """Add one request: one sample of the prompt. For n > 1 samples add n requests, sample
        i with `params.for_sample(i)` and, for i >= 1, `fork_of` = sample 0's id: the siblings
        then share sample 0's prompt blocks (one prefill; see Scheduler.add_request).
        `deadlines`: (total, queue) as absolute wall-clock times, see `_deadlines`.
        `lora`: a `LoRARequest` to run it under that adapter (it becomes `params.lora`, which
        a request carries wherever it goes); None: `params.lora`, the base model by default.
        See `_lora_name`."""
        request = self.make_request(
            prompt,
            params,
            request_id=request_id,
            tenant=tenant,
            priority=priority,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            deadlines=deadlines,
            lora=lora,
        )
        params = request.sampling_params
        # raises on duplicates / prompts over the limit
        if params.structured_output is not None:  # waits here while its grammar compiles
            admit = functools.partial(self.scheduler.add_request, request, fork_of=fork_of)
            self._structured().submit(request, admit, after=fork_of)
        else:
            self.scheduler.add_request(request, fork_of=fork_of)
        self._attach_detokenizer(request)
        self._first[request.request_id] = request
        return request

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str = "default",
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        deadlines: tuple[float | None, float | None] | None = None,
        lora: Any = None,
        output_ids: Sequence[int] = (),
    ) -> Request:
        """The `Request` that `add_request` adds, checked and built but not added: also what
        a request resumed elsewhere with its output so far (`output_ids`) is rebuilt from
        (then given to `import_request`)."""
        params = params or SamplingParams()
        if lora is not None:
            params = dataclasses.replace(params, lora=lora)
        if params.n != 1:
            raise ValueError(
                f"one request is one sample (n={params.n}): add each with params.for_sample(i)"
            )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            try:  # (operator.index: ints, numpy's too; a float or None is no token id)
                prompt_ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError(
                    f"a prompt is a string or a list of token ids (ints), got {prompt!r:.80}"
                ) from None
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if vocab is not None and any(t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if vocab is not None and params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= vocab)
            if bad:
                raise ValueError(
                    f"logit_bias token ids must be in [0, {vocab}); got {', '.join(map(str, bad))}"
                )
        lora_name = self._lora_name(params.lora)
        stop_ids = list(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids.extend(self.eos_token_ids)
        request = Request(
            request_id or f"req-{next(self._ids)}",
            prompt_ids,
            params.max_tokens,
            tenant=tenant,
            priority=priority,
            stop_token_ids=stop_ids,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            sampling_params=params,
            lora_name=lora_name,
        )
        request.deadline, request.queue_deadline = self._deadlines(params, deadlines)
        for token in output_ids:
            request.append_output_token(token)
        if self.salt_rule is not None:
            request.cache_salt = self.salt_rule(request.num_tokens, request.cache_salt)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = PromptLogprobs(len(prompt_ids), params.prompt_logprobs)
        return request

    def check_lora(self, lora: LoRARequest) -> None:
        """Read and validate an adapter for this engine now (a ValueError saying why not), as
        its first request would; it is known here from then on."""
        self._lora_name(lora)

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name` (no longer served): its weights here and its slot go once no
        request here runs under it (at once, or at a later `remove_lora` or adapter read).
        Requests under it that are here already run to their end."""
        if self.scheduler.loras is not None:
            self._retiring_loras.add(name)
            self._sweep_loras()

    def _sweep_loras(self) -> None:
        slots = self.scheduler.loras
        used = {r.lora_name for r in self.scheduler.requests.values()}
        if self.structured is not None:  # (held while their grammar compiles)
            used |= {h.request.lora_name for h in self.structured.held.values()}
        for name in self._retiring_loras - used:
            slots.adapters.pop(name, None)
            slots.pool.evict(name)
        self._retiring_loras &= used

    def _lora_name(self, lora: Any) -> str | None:
        """The adapter name a request runs under. An adapter is read from its path the first
        time its name is used and validated then (a ValueError, and nothing changes); later
        requests naming it reuse it. A name is one adapter: another path under it is refused."""
        if lora is None:
            return None
        slots = self.scheduler.loras
        if slots is None:
            raise ValueError(f"LoRA adapter {lora.name!r}: this engine serves none (max_loras=0)")
        known = slots.adapters.get(lora.name)
        if known is None:
            from fairbatch.engine.lora_adapter import LoRAAdapter

            adapter = LoRAAdapter.load(lora.path, slots.pool.config)
            slots.pool.check(adapter)
            if self._retiring_loras:
                self._sweep_loras()
            slots.adapters[lora.name] = adapter
        elif Path(known.path) != Path(lora.path):
            raise ValueError(
                f"LoRA adapter name {lora.name!r} is already {known.path!r}, not {lora.path!r}"
            )
        return lora.name

    def _deadlines(
        self, params: SamplingParams | None, wall: tuple[float | None, float | None] | None
    ) -> tuple[float, float]:
        """A request's (total, queue) deadlines in the scheduler's clock (inf: none).

        Processes agree on wall-clock time, not on monotonic clocks: a deadline that crosses
        one (set by the cluster's ingress, kept by a resubmission or a move) is an absolute
        `time.time()` value, turned into the scheduler's clock here. Without one, the
        params' relative seconds (`timeout`, `max_queue_time_s`) count from now."""
        now = self.scheduler.clock()
        if wall is None:
            rel = (params.timeout, params.max_queue_time_s) if params else (None, None)
        else:
            wall_now = time.time()
            rel = tuple(None if w is None else w - wall_now for w in wall)
        total, queue = (math.inf if r is None else now + r for r in rel)
        return total, queue

    def wall_deadlines(self, request: Request) -> tuple[float | None, float | None]:
        """`_deadlines`' inverse: the request's deadlines as wall-clock times (None: none)."""
        offset = time.time() - self.scheduler.clock()
        total, queue = (
            None if d == math.inf else d + offset
            for d in (request.deadline, request.queue_deadline)
        )
        return total, queue

    def _attach_detokenizer(self, request: Request) -> None:
        if self.tokenizer is None:
            return
        params = request.sampling_params or SamplingParams()
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output,
            stop_token_ids=request.stop_token_ids,  # (EOS among them unless ignore_eos)
        )
        for token in request.output_token_ids:  # a migrated request: text already delivered
            detok.add_token(token)
        self.detoks[request.request_id] = detok

    def abort(self, request_id: str) -> bool:
        self.detoks.pop(request_id, None)
        self.scheduler.ended_preemptions.pop(request_id, None)
        self._first.pop(request_id, None)
        held = self.structured is not None and self.structured.take(request_id) is not None
        return self.scheduler.abort(request_id) or held

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.structured and self.structured.held)

    def _structured(self) -> StructuredOutput:
        if self.structured is None:
            if not hasattr(self.runner, "logits_mask"):
                raise ValueError("structured output needs a runner that samples from logits")
            self.structured = StructuredOutput(
                self.tokenizer, self.vocab_size, self.eos_token_ids, self.scheduler
            )
            self.runner.logits_mask = self.structured.mask
        return self.structured

    def stats(self) -> dict:
        """Cumulative counters and current occupancy (what a benchmark reads before and after)."""
        s = self.scheduler
        cache = getattr(self.runner, "cache", None)
        pool = s.kv.gpu_pool
        return {
            "preemptions": dict(s.num_preemptions),
            "swapped_blocks": dict(s.num_swapped_blocks),
            "swapped_bytes": dict(cache.bytes_swapped)
            if cache is not None
            else {"in": 0, "out": 0},
            "prefix_hit_tokens": s.num_prefix_hit_tokens,
            # the host tier (kv/manager.py): blocks held, capacity, stored / loaded / evicted
            "host_tier": {**s.kv.host_tier_stats(), "hit_tokens": s.num_host_hit_tokens},
            "running": len(s.running),
            "waiting": s.num_waiting,
            "swapped": len(s.swapped),
            "kv_usage": 1.0 - s.kv.num_free_blocks / max(pool.num_blocks, 1),
            # per tenant: weighted service, and the virtual counters (service / weight)
            "tenant_service": s.policy.service(),
            "tenant_counters": s.policy.counters(),
        }

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        failed = []  # requests whose grammar failed while they were held
        if self.structured is not None:
            failed = self.structured.admit_ready(idle=not self.scheduler.has_unfinished)
        out = self.scheduler.schedule()
        runner_out = self.runner.execute(out)
        updates = self.scheduler.update_from_output(out, runner_out)
        finished_map = updates.finished
        if self.structured is not None:  # matchers take the new tokens; done grammars stop
            finished_map = self.structured.advance(updates.new_tokens, finished_map)
        if self.salt_rule is not None:
            self._resalt(updates.new_tokens, finished_map)
        logprobs = runner_out.logprobs
        deltas = []
        for rid, token in updates.new_tokens.items():
            deltas.append(self._delta(rid, [token], finished_map.get(rid), logprobs.get(rid)))
        for rid, reason in finished_map.items():
            if rid not in updates.new_tokens:
                deltas.append(self._delta(rid, [], reason, None))
        for rid, key in out.timed_out.items():  # evicted past a deadline, before the step
            self.timed_out[key] += 1
            deltas.append(self._delta(rid, [], "timeout", None))
        deltas.extend(self._delta(rid, [], "error", None) for rid in failed)
        if self._first:
            for d in deltas:
                request = self._first.pop(d.request_id, None)
                if request is not None:
                    self._first_delta(d, request)
        return deltas

    def _resalt(self, new_tokens: dict, finished: dict) -> None:
        """A request whose salt the model's rule changed with its new token (longrope past the
        original length, engine/models/rope.py): its K/V are recomputed under the new salt
        (preempted by recompute, its output kept), as transformers' longrope `generate` does."""
        rule = self.salt_rule
        for rid in new_tokens:
            request = self.scheduler.requests.get(rid)
            if request is None or rid in finished:
                continue
            n, salt = request.num_tokens, request.cache_salt
            if rule(n, salt) != rule(n - 1, salt):  # (it changes once: `salt` is the base one)
                self.preempt(rid, "recompute")  # blocks cached under the old salt
                self.scheduler.kv.forget(request)  # and its hash chain with them
                request.cache_salt = rule(n, salt)

    @staticmethod
    def _first_delta(d: RequestDelta, request: Request) -> None:
        d.num_cached_tokens = request.num_cached_tokens or 0
        plp = request.prompt_logprobs
        if plp is not None and not plp.sent and not plp.num_missing:
            d.prompt_logprobs = plp.entries
            plp.sent = True

    def _delta(self, rid: str, tokens: list[int], reason: str | None, lp) -> RequestDelta:
        text, finished = "", reason is not None
        detok = self.detoks.get(rid)
        if detok is not None:
            decoded = tokens
            if reason == "stop" and tokens and tokens[-1] in detok.stop_token_ids:
                # The token that stopped it (EOS or a stop token id) is not output text, as a
                # stop string is not (and as in vLLM), unless `include_stop_str_in_output`.
                if not detok.include_stop_str_in_output:
                    decoded = tokens[:-1]
            for token in decoded:
                text += detok.add_token(token)
            if detok.stopped and not finished:
                # A stop string ended it: the scheduler frees its blocks now.
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                finished, reason = True, "stop"
            elif finished and not detok.stopped:
                text += detok.finish()
            if finished:
                del self.detoks[rid]
        delta = RequestDelta(rid, tokens, text, finished, reason, [lp] if lp else None)
        if finished:
            delta.num_preemptions = self.scheduler.ended_preemptions.pop(rid, 0)
        return delta

    # ---- controller hooks -------------------------------------------------------------------

    def preempt(self, request_id: str, mode: str = "auto", seat_for: str | None = None) -> bool:
        out = self.scheduler.preempt(request_id, mode, seat_for)
        if out is None:
            return False
        self.runner.execute(out)  # issues the swap-out copies; schedules nothing
        return True

    def export_request(self, request_id: str) -> MigratedRequest:
        """Take a waiting or swapped request out, with its K/V bytes if it was swapped."""
        held = self.structured.take(request_id) if self.structured is not None else None
        if held is not None:  # still waiting for its grammar: nothing to take from the scheduler
            request, cpu_ids = held, None
        else:
            request, cpu_ids = self.scheduler.export_request(request_id)
        self.detoks.pop(request_id, None)
        self._first.pop(request_id, None)
        blocks = None
        if cpu_ids is not None and hasattr(self.runner, "cache"):
            blocks = self.runner.cache.export_blocks(cpu_ids)  # read before the next step
        if blocks is None:
            request.num_computed_tokens = 0  # no K/V travels with it: resume by recompute
        return MigratedRequest(request, blocks, {"deadlines": self.wall_deadlines(request)})

    def import_request(self, migrated: MigratedRequest) -> None:
        request = migrated.request
        if request.sampling_params is not None:  # its adapter, known here from now (or refused)
            self._lora_name(request.sampling_params.lora)
        wall = migrated.extra.get("deadlines")
        if wall is not None:  # the deadlines it had where it came from, in this clock
            request.deadline, request.queue_deadline = self._deadlines(None, wall)
        params = request.sampling_params
        if params is not None and params.structured_output is not None:
            # its matcher is rebuilt from its output tokens (held while the grammar compiles)
            admit = functools.partial(self._import_kv, migrated)
            self._structured().submit(request, admit)
        else:
            self._import_kv(migrated)
        self._attach_detokenizer(request)
        if request.num_output_tokens == 0:  # moved before its first token
            self._first[request.request_id] = request

    def _import_kv(self, migrated: MigratedRequest) -> None:
        num_blocks = 0 if migrated.kv_blocks is None else migrated.kv_blocks.shape[2]
        cpu_ids = self.scheduler.import_request(migrated.request, num_blocks)
        if cpu_ids is not None:
            self.runner.cache.import_blocks(cpu_ids, migrated.kv_blocks)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        rows = getattr(self.runner, "block_rows", None)  # (a simulated runner keeps none)
        if rows is not None:
            rows.check(self.scheduler.kv.req_block_ids)
