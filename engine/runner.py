"""ModelRunner: executes one SchedulerOutput on the real model.

block copies, swap copies -> flattened batch -> one forward -> logits of the rows that sample
-> sampler.

On CUDA the step's integer inputs (with the attention backend's plan and the rows to sample
and to score) reach the device in one non-blocking copy from a pinned buffer
(engine/staging.py), the sampler's settings in one more, and decode-only steps replay a
captured CUDA graph when the runner has them (engine/cuda_graphs.py). The host waits for the
device once per step: when it reads the sampled tokens, their logprobs and the prompt
logprobs, all together. Forward time is taken with CUDA events, read once they have
completed. On CPU a step is built as plain tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from fairbatch.engine.attention import AttentionMetadata
from fairbatch.engine.cuda_graphs import (
    INPUT_NAMES,
    DecodeGraphs,
    graph_step_inputs,
    padded_batch_size,
)
from fairbatch.engine.models import CausalLM
from fairbatch.engine.sampler import Sampler
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.engine.staging import IntRows, Staging, host_ints, read_to_host
from fairbatch.kv.cache_engine import CacheEngine
from fairbatch.scheduler.output import RunnerOutput, SchedulerOutput

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class _OutputsOf(Sequence):
    """Row i's output tokens (`requests[i].output_token_ids`), made when the sampler reads row
    i: only rows with penalties or random sampling do, so a greedy batch makes none."""

    __slots__ = ("_requests",)

    def __init__(self, requests: list) -> None:
        self._requests = requests

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [r.output_token_ids for r in self._requests[i]]
        return self._requests[i].output_token_ids


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache_engine: CacheEngine,
        sampler: Sampler | None = None,
        stage_inputs: bool | None = None,  # one staged copy per step; default: on CUDA
    ) -> None:
        self.model = model
        self.cache = cache_engine
        self.kv_caches = cache_engine.layer_caches()
        self.block_size = cache_engine.layout.block_size
        self.device = cache_engine.device
        self.sampler = sampler or Sampler()
        # (logits, requests) -> logits with each constrained row's disallowed tokens at -inf
        # (engine/structured.py); set by the engine on its first constrained request
        self.logits_mask = None
        self.forward_time = 0.0  # seconds spent in model forward + logits (for the benchmark)
        self.num_steps = 0
        if stage_inputs is None:
            stage_inputs = self.cache.is_cuda
        self.staging = Staging(self.device) if stage_inputs else None
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0
        self.block_rows = IntRows()  # the requests' block tables as arrays, kept across steps
        self._timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # not yet read
        # LoRA adapters (engine/lora.py's attach_lora): the step's slot per token goes here
        self.lora = None
        # a rotary that reads the step's schedule (longrope's per-sequence flags), or None
        rotary = model.model.rotary
        self._rotary_step = rotary.set_step if rotary.reads_schedule else None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward at the padded batch sizes up to `max_num_seqs`."""
        backend = self.model.attn_backend(self.device, self.cache.layout.dtype)
        if not self.cache.is_cuda or self.cache.pad_block is None or self.staging is None:
            raise ValueError("CUDA graphs need a CUDA cache engine with a pad block")
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name!r} attention backend cannot be captured")
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.block_size,
            max_num_seqs,
            max_model_len,
            self.cache.pad_block,
        )
        graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        # In SchedulerOutput's order: host-tier stores first (everything after may write
        # their device blocks), then block copies (a swap-in may overwrite a freed copy source,
        # a swap-out may read a copy target), swap-ins, swap-outs, host-tier loads (into blocks
        # a swap-out may have freed).
        if self.cache.is_cuda:
            self.cache.wait_loads()  # the last step's loads: their requests compute now
        self.cache.store(out.kv_store)
        self.cache.copy_blocks(out.copy_blocks)
        self.cache.swap_in(out.swap_in)
        self.cache.swap_out(out.swap_out)
        self.cache.load(out.kv_load)
        if self.cache.is_cuda:
            self.cache.poll()
        if not out.scheduled:
            return RunnerOutput()
        self.num_steps += 1

        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[Sequence[int]] = []  # int32 arrays (IntRows)
        sample_rows: list[int] = []  # token index (in the flat batch) of each sampling request
        sample_reqs = []
        scored: list[tuple] = []  # (request, first position, first row, rows) for prompt logprobs
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            first_row = len(input_ids)
            input_ids.extend(req.all_token_ids[start : start + n])
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(self.block_rows.row(req.request_id, out.block_tables[req.request_id]))
            if start + n == len(req.all_token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
            plp = req.prompt_logprobs
            if plp is not None and plp.num_missing:
                # position p's logits score prompt token p + 1 (the last prompt position's
                # logits are the first sample's, not a prompt record)
                end = min(start + n, req.num_prompt_tokens - 1)
                if end > start:
                    scored.append((req, start, first_row, end - start))

        self.block_rows.prune(out.block_tables)
        # Rows strictly increase, so they are 0, 1, ... exactly when the last is len - 1.
        in_order = not sample_rows or sample_rows[-1] == len(sample_rows) - 1
        extra = [] if in_order else [torch.tensor(sample_rows)]
        if scored:
            score_rows, score_targets = _prompt_rows(scored)
            extra += [torch.tensor(score_rows), torch.tensor(score_targets)]

        if self.lora is not None:
            self._set_lora_slots(out)
        if self._rotary_step is not None:
            self._rotary_step(out, self.device)
        t0 = time.perf_counter()
        timer = self._start_timer()
        hidden, staged = self._forward(input_ids, query_lens, seq_lens, tables, extra)
        score: list[torch.Tensor] = []
        if scored:
            top_n = max(req.prompt_logprobs.top for req, *_ in scored)
            score = self._score_prompts(hidden, staged[-2], staged[-1], top_n)
        pending = None
        if sample_reqs:
            picked = hidden[: len(sample_rows)] if in_order else hidden.index_select(0, staged[0])
            logits = self.model.compute_logits(picked)  # [num_samples, vocab]
        self._stop_timer(timer, t0)
        if sample_reqs:
            if self.logits_mask is not None:
                logits = self.logits_mask(logits, sample_reqs)
            params = [r.sampling_params or _GREEDY for r in sample_reqs]
            pending = self.sampler.sample_async(
                logits,
                params,
                [r.prompt_token_ids for r in sample_reqs],
                _OutputsOf(sample_reqs),
            )
        sample = pending.tensors if pending is not None else []
        host = read_to_host(sample + score)  # the step's only wait for the device
        self._read_timers()  # the results are on the host: the forward has finished
        if scored:
            _fill_prompt_logprobs(scored, score_targets, host[len(sample) :])
        if pending is None:
            return RunnerOutput()
        result = pending.result(host[: len(sample)])
        sampled = {r.request_id: t for r, t in zip(sample_reqs, result.token_ids)}
        logprobs = {
            r.request_id: lp for r, lp in zip(sample_reqs, result.logprobs) if lp is not None
        }
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _forward(
        self,
        input_ids: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        extra: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states `[num_tokens, hidden]`, and `extra` (CPU int64 tensors: row indices)
        as int64 on the device, staged in the step's one copy."""
        if self.staging is None:  # CPU: plain tensors
            meta, positions = AttentionMetadata.build(
                query_lens, seq_lens, tables, self.block_size, self.device
            )
            ids = host_ints(input_ids).to(self.device)
            return self.model(ids, positions, self.kv_caches, meta), extra
        n = len(INPUT_NAMES)
        # (a graph turns by position only: not with a long sequence's one-token prefill chunk)
        flagged = self.model.model.rotary.long_tokens is not None
        batch = None if flagged else self._graph_batch(query_lens, tables)
        if batch is not None:
            g = self.graphs
            arrays = graph_step_inputs(
                input_ids, seq_lens, tables, batch, g.width, self.block_size, g.pad_block
            )
            views = self.staging.upload(arrays + extra, out=g.static)
            self.num_graph_steps += 1
            hidden = g.replay(batch, views[0])[: len(input_ids)]
        else:
            host = AttentionMetadata.host_inputs(query_lens, seq_lens, tables, self.block_size)
            host["ids"] = host_ints(input_ids)
            plan = self.model.attn_step_plan(
                query_lens, seq_lens, host["block_tables"], self.block_size
            )
            plan_arrays = plan.arrays if plan is not None else []
            views = self.staging.upload([host[k] for k in INPUT_NAMES] + plan_arrays + extra)
            dev = dict(zip(INPUT_NAMES, views))
            meta, positions = AttentionMetadata.from_device(
                dev, query_lens, seq_lens, host["block_tables"]
            )
            if plan is not None:
                plan.attach(meta, views[n : n + len(plan_arrays)])
            n += len(plan_arrays)
            hidden = self.model(dev["ids"].long(), positions, self.kv_caches, meta)
        return hidden, [v.long() for v in views[n:]]

    def _set_lora_slots(self, out: SchedulerOutput) -> None:
        """The step's rows grouped by adapter slot for the model's LoRA projections; None
        when no request of the step has an adapter (nothing extra runs)."""
        if all(req.lora_name is None for req in out.scheduled):
            self.lora.groups = None  # a base-only step builds nothing
            return
        pool = self.lora.pool
        spans = [
            (-1 if req.lora_name is None else pool.slot_of(req.lora_name),
             out.num_scheduled_tokens[req.request_id])
            for req in out.scheduled
        ]  # fmt: skip
        self.lora.groups = pool.groups(spans, self.device)

    def _graph_batch(self, query_lens: list[int], tables: list[list[int]]) -> int | None:
        """The captured batch size this step replays, or None to run it eagerly."""
        g = self.graphs
        if g is None or any(q != 1 for q in query_lens):
            return None
        if any(len(t) > g.width for t in tables):
            return None
        return padded_batch_size(len(query_lens), g.sizes)

    def _start_timer(self) -> torch.cuda.Event | None:
        if not self.cache.is_cuda:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _stop_timer(self, start: torch.cuda.Event | None, t0: float) -> None:
        if start is None:
            self.forward_time += time.perf_counter() - t0
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timers.append((start, end))

    def _read_timers(self) -> None:
        """Add the finished CUDA-timed forwards to `forward_time` (no waiting)."""
        while self._timers and self._timers[0][1].query():
            start, end = self._timers.pop(0)
            self.forward_time += start.elapsed_time(end) / 1e3

    def _score_prompts(
        self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, top_n: int
    ) -> list[torch.Tensor]:
        """The prompt positions' log-probs on the device (one logits call for all of them):
        each target's `[r]`, then with `top_n` the top values and ids `[r, top_n]`;
        `log_softmax` of the model's logits, as the sampler's logprobs."""
        logprobs = self.model.compute_logits(hidden.index_select(0, rows)).log_softmax(dim=-1)
        picked = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        return [picked, *logprobs.topk(top_n, dim=-1)] if top_n else [picked]


def _prompt_rows(scored: list[tuple]) -> tuple[list[int], list[int]]:
    """The flat batch rows of the prompt positions scored this step, and the prompt token
    each one's logits score (position p's logits score token p + 1)."""
    rows, targets = [], []
    for req, start, first_row, count in scored:
        rows.extend(range(first_row, first_row + count))
        targets.extend(req.all_token_ids[start + 1 : start + 1 + count])
    return rows, targets


def _fill_prompt_logprobs(scored: list[tuple], targets: list[int], host: list[list]) -> None:
    """Fill the prompt log-prob records from `_score_prompts`' values read to the host."""
    picked, top_vals, top_ids = host[0], *(host[1:] or (None, None))
    j = 0
    for req, start, _, count in scored:
        plp, k = req.prompt_logprobs, req.prompt_logprobs.top
        for p in range(start + 1, start + 1 + count):
            if plp.entries[p] is None:  # recomputed after preemption: keep the first
                entry = [(targets[j], picked[j])]
                if k:
                    entry.extend(zip(top_ids[j][:k], top_vals[j][:k]))
                plp.entries[p] = entry
                plp.num_missing -= 1
            j += 1
