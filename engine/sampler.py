"""Turn one step's logits into one next token per request.

Pipeline per row, in this order (vLLM v0 / Hugging Face order):

1. penalties: repetition (tokens in prompt + output: positive logits divided, negative
   multiplied), then frequency (`-= f * count in output`) and presence (`-= p` if in output);
   then `logit_bias` is added (one scatter over the biased rows: +100 all but forces a token,
   -100 all but bans it);
2. greedy rows: argmax of the penalized logits; the rest:
3. temperature, then top-k, top-p, min-p filtering (filtered tokens get -inf);
4. softmax and an exponential race: `argmax(probs / q)` with `q ~ Exp(1)` per token, which
   picks token i with probability probs[i] and lets every row draw `q` from its own stream.

All of it is batched tensor work over `[num_rows, vocab]`; Python loops run over rows only
(building penalty counts, drawing seeded noise, formatting logprobs), never over the vocab.

Seeding contract (what preemption, recompute and migration rely on): for a row whose
`SamplingParams.seed` is set, the noise `q` is drawn from a generator seeded with
`derive_seed(seed, step)`, where `step = len(output_token_ids)` for that row. Every op applied
to a row depends only on that row, so the next token is a pure function of (seed, prompt
tokens, output tokens so far, the model's logits for that row): independent of the batch it
runs in, of earlier steps' randomness, and of where the request was resumed. There are no
stateful per-request generators to carry across a swap or a move. The stream depends on the
device type (CPU and CUDA generators differ) and on the vocab size of the logits. Rows without
a seed draw from the sampler's shared generator (the torch default one unless given).

Logprobs follow vLLM's default ("raw logprobs"): they are `log_softmax` of the logits as the
model produced them, before penalties, temperature and filtering, so they describe the model,
not the sampling recipe. For a row with `logprobs=N` the entry is
`[(sampled_id, logprob), (top1_id, logprob), ..., (topN_id, logprob)]`: the sampled token first
(always present, even with N = 0), then the N most likely tokens, most likely first (the sampled
token may appear again among them).

Transfers (what keeps a CUDA step free of host waits): everything a pass needs from the host
(row indices, penalty token lists, temperatures, top-k/p, min-p, biases) is built as CPU
tensors first and reaches the device in one staged non-blocking copy (engine/staging.py);
the device work then reads only those views and the logits. `sample_async` leaves the result
on the device, so the caller reads it together with the rest of its step in one wait;
`sample` is that plus the read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fairbatch.engine.sampling_params import SamplingParams, derive_seed
from fairbatch.engine.staging import IntRows, Staging, read_to_host


@dataclass
class SamplerOutput:
    """One step's result for a batch of rows."""

    token_ids: list[int]  # the sampled token of each row
    # Per row: None unless the row asked for logprobs, else [(sampled, lp), (top1, lp), ...].
    logprobs: list[list[tuple[int, float]] | None]


@dataclass
class PendingSample:
    """A sampling pass issued on the device, not yet read. `tensors`: the token ids `[rows]`,
    then for the rows with logprobs their sampled token's logprob and, when any asked for
    top entries, the top values and ids. `result` takes their `tolist()` values."""

    tensors: list[torch.Tensor]
    logprob_rows: list[int]  # the rows with logprobs, in order
    top_n: list[int]  # per logprob row: how many top entries it asked for

    def result(self, host: list[list]) -> SamplerOutput:
        tokens = host[0]
        logprobs: list[list[tuple[int, float]] | None] = [None] * len(tokens)
        if self.logprob_rows:
            sampled_lp = host[1]
            top_vals, top_ids = host[2:4] if len(host) > 2 else (None, None)
            for j, i in enumerate(self.logprob_rows):
                entry = [(tokens[i], sampled_lp[j])]
                if self.top_n[j]:
                    entry.extend(zip(top_ids[j][: self.top_n[j]], top_vals[j][: self.top_n[j]]))
                logprobs[i] = entry
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)


def make_generator(
    seed: int | None, step: int, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A fresh generator for (seed, step) on `device`, or None when `seed` is None."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, step))
    return gen


class Sampler:
    """Samples one token per row; stateless apart from the generator for unseeded rows (and
    reused scratch: a seeded-row generator and the staging buffers)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded rows draw from this (None = torch's default generator for the device).
        self.generator = generator
        # One reusable generator per device for seeded rows: manual_seed resets it completely,
        # so reuse is equivalent to make_generator() without an allocation per row and step.
        self._scratch: dict[torch.device, torch.Generator] = {}
        self.staging: Staging | None = None  # for the logits' device, made on first use
        self._prompts = IntRows()  # penalized rows' prompts as arrays, by the list's id

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
    ) -> SamplerOutput:
        """Pick the next token of each row of `logits` ([num_rows, vocab]); never mutates it.

        `prompt_token_ids[i]` and `output_token_ids[i]` are row i's prompt and the tokens it has
        generated so far: penalties read them, and `len(output_token_ids[i])` is the step index
        of the seeding contract (see the module docstring).
        """
        pending = self.sample_async(logits, params, prompt_token_ids, output_token_ids)
        return pending.result(read_to_host(pending.tensors))

    def sample_async(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
    ) -> PendingSample:
        """`sample` without the read: at most one host->device copy, no wait."""
        num_rows, vocab = logits.shape
        if not (len(params) == len(prompt_token_ids) == len(output_token_ids) == num_rows):
            raise ValueError(
                f"batch mismatch: {num_rows} logits rows, {len(params)} params, "
                f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs"
            )
        logits = logits.float()
        raw_logits = logits  # logprobs describe the model, so keep the unpenalized logits
        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        rand_params = [params[i] for i in rand_rows]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        host = {
            **_penalty_inputs(params, prompt_token_ids, output_token_ids, vocab, self._prompts),
            **_bias_inputs(params),
            **_random_inputs(rand_rows, rand_params, num_rows, vocab),
        }
        if lp_rows:
            host["lp_rows"] = torch.tensor(lp_rows)
        dev = self._upload(host, logits.device)

        if "pen_rows" in dev:
            logits = _apply_penalties_to_rows(logits, dev)
        if "bias_rows" in dev:
            logits = _apply_logit_bias(logits, dev)
        steps = [len(output_token_ids[i]) for i in rand_rows]
        if not rand_rows:
            token_ids = logits.argmax(dim=-1)  # fast path: every row greedy
        elif len(rand_rows) == num_rows:
            token_ids = self._sample_random(logits, rand_params, steps, dev)
        else:
            idx = dev["rand_rows"]
            sampled = self._sample_random(logits.index_select(0, idx), rand_params, steps, dev)
            token_ids = logits.argmax(dim=-1).index_copy(0, idx, sampled)

        tensors = [token_ids]
        top_n = [params[i].logprobs or 0 for i in lp_rows]
        if lp_rows:
            idx = dev["lp_rows"]
            logprobs = raw_logits.index_select(0, idx).log_softmax(dim=-1)
            sampled_ids = token_ids.index_select(0, idx).unsqueeze(1)
            tensors.append(logprobs.gather(1, sampled_ids).squeeze(1))
            if max(top_n):
                tensors.extend(logprobs.topk(max(top_n), dim=-1))  # values, ids
        return PendingSample(tensors, lp_rows, top_n)

    def _upload(self, host: dict[str, torch.Tensor], device: torch.device) -> dict:
        """`host`'s tensors on `device` in one staged copy; integer ones as int64 there (the
        index type index_copy_, gather and scatter_add_ take)."""
        if not host:
            return {}
        if self.staging is None or self.staging.device != device:
            self.staging = Staging(device)
        views = self.staging.upload(list(host.values()))
        return {k: v if v.is_floating_point() else v.long() for k, v in zip(host, views)}

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        steps: list[int],
        dev: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Temperature, filtering and the exponential race on non-greedy rows ([r, vocab]);
        `dev` holds the rows' staged settings (`_random_inputs`)."""
        logits = logits / dev["temps"].unsqueeze(1)
        if "top_k" in dev or "top_p" in dev:
            logits = apply_top_k_top_p(logits, dev.get("top_k"), dev.get("top_p"))
        if "min_p" in dev:
            logits = apply_min_p(logits, dev["min_p"])

        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        seeded = [j for j, p in enumerate(params) if p.seed is not None]
        if not seeded:
            q.exponential_(generator=self.generator)
        else:
            if "unseeded" in dev:
                u_idx = dev["unseeded"]
                noise = torch.empty((u_idx.shape[0], q.shape[1]), device=q.device, dtype=q.dtype)
                q.index_copy_(0, u_idx, noise.exponential_(generator=self.generator))
            gen = self._scratch_generator(q.device)
            for j in seeded:
                # manual_seed only sets host-side state: the kernel takes seed and offset by
                # value, so reseeding for the next row cannot change this one's noise
                gen.manual_seed(derive_seed(params[j].seed, steps[j]))
                q[j].exponential_(generator=gen)
        # Exp(1) can come out as exactly 0: clamp so a zero-probability token never gets 0/0=NaN
        # (argmax would pick NaN) and a possible token gets a huge but finite score.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)

    def _scratch_generator(self, device: torch.device) -> torch.Generator:
        gen = self._scratch.get(device)
        if gen is None:
            gen = self._scratch[device] = torch.Generator(device=device)
        return gen


# ---- host side: a pass's settings as CPU tensors (staged in one copy) ------------------------


def _f32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _padded(token_lists: list[Sequence[int]], pad: int) -> torch.Tensor:
    """`[rows, longest]` int32 token ids (staged as int32 anyway), short rows padded with `pad`.
    A row may be a list or an int array (`IntRows`); either is copied in C."""
    width = max((len(t) for t in token_lists), default=0)
    out = np.full((len(token_lists), width), pad, np.int32)
    for i, tokens in enumerate(token_lists):
        out[i, : len(tokens)] = tokens
    return torch.from_numpy(out)


def _penalty_inputs(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab: int,
    prompt_rows: IntRows | None = None,
) -> dict[str, torch.Tensor]:
    """The rows with penalties, their prompt and output tokens (padded with the id `vocab`,
    a column `_token_counts` drops) and their three penalties; {} when no row has any.
    `prompt_rows` keeps each prompt (a list that never changes) as an array across steps: a
    prompt of thousands of tokens is then not converted from Python ints every step."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return {}
    prompts = [prompt_token_ids[i] for i in rows]
    if prompt_rows is not None:
        prompt_rows.prune({id(p): p for p in prompts})  # (the prompts of ended requests)
        prompts = [prompt_rows.row(id(p), p) for p in prompts]
    return {
        "pen_rows": torch.tensor(rows),
        "pen_prompt": _padded(prompts, vocab),
        "pen_output": _padded([output_token_ids[i][:] for i in rows], vocab),  # (views: lists)
        "presence": _f32([params[i].presence_penalty for i in rows]),
        "frequency": _f32([params[i].frequency_penalty for i in rows]),
        "repetition": _f32([params[i].repetition_penalty for i in rows]),
    }


def _bias_inputs(params: Sequence[SamplingParams]) -> dict[str, torch.Tensor]:
    """Every (row, token, bias) of the rows' `logit_bias`, flattened; {} when none."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            ids.append(token)
            values.append(bias)
    if not rows:
        return {}
    return {"bias_rows": torch.tensor(rows), "bias_ids": torch.tensor(ids), "bias": _f32(values)}


def _random_inputs(
    rand_rows: list[int], params: list[SamplingParams], num_rows: int, vocab: int
) -> dict[str, torch.Tensor]:
    """The non-greedy rows' settings, only those some row uses; `rand_rows` when not every
    row samples, `unseeded` (positions among the random rows) when seeds are mixed."""
    if not rand_rows:
        return {}
    out = {"temps": _f32([p.temperature for p in params])}
    if len(rand_rows) < num_rows:
        out["rand_rows"] = torch.tensor(rand_rows)
    if any(p.uses_top_k for p in params):
        ks = [min(p.top_k, vocab) if p.uses_top_k else vocab for p in params]
        out["top_k"] = torch.tensor(ks)
    if any(p.uses_top_p for p in params):
        out["top_p"] = _f32([p.top_p for p in params])
    if any(p.uses_min_p for p in params):
        out["min_p"] = _f32([p.min_p for p in params])
    unseeded = [j for j, p in enumerate(params) if p.seed is None]
    if unseeded and len(unseeded) < len(params):
        out["unseeded"] = torch.tensor(unseeded)
    return out


# ---- device side ------------------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor,
    prompt_index: torch.Tensor,
    output_index: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of `logits` ([r, vocab]); penalty tensors are [r], the token indices
    `[r, width]` (any integer type) padded with the id `vocab`.

    Repetition (CTRL paper, as vLLM/HF): tokens present in prompt or output have positive
    logits divided by the penalty and negative ones multiplied. Then OpenAI's frequency
    (per output occurrence) and presence (once if in the output) penalties are subtracted.
    """
    vocab = logits.shape[1]
    out_counts = _token_counts(output_index, vocab)
    in_output = out_counts > 0
    seen = in_output | (_token_counts(prompt_index, vocab) > 0)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency.unsqueeze(1) * out_counts
    return logits - presence.unsqueeze(1) * in_output.to(logits.dtype)


def _apply_penalties_to_rows(logits: torch.Tensor, dev: dict[str, torch.Tensor]) -> torch.Tensor:
    """Copy of `logits` with penalties applied to the rows `_penalty_inputs` chose (the others
    cost nothing); `dev` holds its tensors on the logits' device."""
    idx = dev["pen_rows"]
    penalized = apply_penalties(
        logits.index_select(0, idx),
        dev["pen_prompt"],
        dev["pen_output"],
        dev["presence"],
        dev["frequency"],
        dev["repetition"],
    )
    return logits.index_copy(0, idx, penalized)


def _apply_logit_bias(logits: torch.Tensor, dev: dict[str, torch.Tensor]) -> torch.Tensor:
    """Copy of `logits` with the staged biases added (ids were checked against the vocab when
    the request was added)."""
    out = logits.clone()
    out.index_put_((dev["bias_rows"], dev["bias_ids"]), dev["bias"], accumulate=True)
    return out


def _token_counts(index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 counts of each token id per row of `index` ([rows, width], padded
    with the id `vocab`): one scatter_add for all rows, the padding column dropped."""
    counts = torch.zeros((index.shape[0], vocab + 1), dtype=torch.float32, device=index.device)
    if index.shape[1]:
        counts.scatter_add_(1, index.long(), torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Copy of `logits` ([r, vocab]) with tokens outside top-k and/or top-p set to -inf.

    `top_k` ([r], ints in 1..vocab; vocab = off) keeps every token whose logit is >= the k-th
    largest (ties at the boundary are all kept). `top_p` ([r], in (0, 1]; 1 = off) keeps the
    smallest set of most likely tokens whose probability mass is >= p (at least one token).
    A row with neutral values comes out unchanged, so rows never affect each other.
    """
    # Ascending order: the tokens to drop form a prefix of each row. Stable so ties order the
    # same way whatever the batch, which the seeding contract needs.
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab - top_k.long()).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, -float("inf"))
    if top_p is not None:
        # Mass of each token and all less likely ones; drop while the rest still holds >= p.
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Copy of `logits` ([r, vocab]) without tokens whose prob < min_p * (max prob); min_p [r].

    Done in logit space (p_i / p_max = exp(l_i - l_max)), which needs no softmax; min_p = 0
    gives a threshold of -inf and changes nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, -float("inf"))
