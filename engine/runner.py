"""ModelRunner: executes one SchedulerOutput on the real model.

block copies, swap copies -> flattened batch -> one forward -> logits of the rows that sample
-> sampler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from fairbatch.engine.attention import AttentionMetadata
from fairbatch.engine.model import LlamaForCausalLM
from fairbatch.engine.sampler import Sampler
from fairbatch.engine.sampling_params import SamplingParams
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
        model: LlamaForCausalLM,
        cache_engine: CacheEngine,
        sampler: Sampler | None = None,
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

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        # Block copies first: a swap-in may overwrite a freed copy source, a swap-out may read
        # a copy target. Then swap-ins: a swap-out of this step may reuse the CPU blocks they
        # read.
        self.cache.copy_blocks(out.copy_blocks)
        self.cache.swap_in(out.swap_in)
        self.cache.swap_out(out.swap_out)
        if self.cache.is_cuda:
            self.cache.poll()
        if not out.scheduled:
            return RunnerOutput()
        self.num_steps += 1

        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
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
            tables.append(out.block_tables[req.request_id])
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

        t0 = time.perf_counter()
        meta, positions = AttentionMetadata.build(
            query_lens, seq_lens, tables, self.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        if scored:
            self._score_prompts(hidden, scored)
        if not sample_reqs:
            self.forward_time += time.perf_counter() - t0
            return RunnerOutput()
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_samples, vocab]
        if self.cache.is_cuda:
            torch.cuda.synchronize(self.device)  # honest timing of the forward
        self.forward_time += time.perf_counter() - t0

        if self.logits_mask is not None:
            logits = self.logits_mask(logits, sample_reqs)
        params = [r.sampling_params or _GREEDY for r in sample_reqs]
        result = self.sampler.sample(
            logits,
            params,
            [r.prompt_token_ids for r in sample_reqs],
            _OutputsOf(sample_reqs),
        )
        sampled = {r.request_id: t for r, t in zip(sample_reqs, result.token_ids)}
        logprobs = {
            r.request_id: lp for r, lp in zip(sample_reqs, result.logprobs) if lp is not None
        }
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _score_prompts(self, hidden: torch.Tensor, scored: list[tuple]) -> None:
        """Fill the prompt log-prob records of this step's prompt positions (one logits call
        for all of them): `log_softmax` of the model's logits, as the sampler's logprobs."""
        rows, targets = [], []
        for req, start, first_row, count in scored:
            rows.extend(range(first_row, first_row + count))
            targets.extend(req.all_token_ids[start + 1 : start + 1 + count])
        dev = self.device
        logits = self.model.compute_logits(
            hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev))
        )
        logprobs = logits.float().log_softmax(dim=-1)
        picked = logprobs.gather(1, torch.tensor(targets, device=dev).unsqueeze(1)).squeeze(1)
        top_n = max(req.prompt_logprobs.top for req, *_ in scored)
        top_vals = top_ids = None
        if top_n:
            top_vals, top_ids = (t.tolist() for t in logprobs.topk(top_n, dim=-1))
        picked_l = picked.tolist()
        j = 0
        for req, start, _, count in scored:
            plp, k = req.prompt_logprobs, req.prompt_logprobs.top
            for p in range(start + 1, start + 1 + count):
                if plp.entries[p] is None:  # recomputed after preemption: keep the first
                    entry = [(targets[j], picked_l[j])]
                    if k:
                        entry.extend(zip(top_ids[j][:k], top_vals[j][:k]))
                    plp.entries[p] = entry
                    plp.num_missing -= 1
                j += 1
