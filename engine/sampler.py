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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fairbatch.engine.sampling_params import SamplingParams, derive_seed


@dataclass
class SamplerOutput:
    """One step's result for a batch of rows."""

    token_ids: list[int]  # the sampled token of each row
    # Per row: None unless the row asked for logprobs, else [(sampled, lp), (top1, lp), ...].
    logprobs: list[list[tuple[int, float]] | None]


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
    """Samples one token per row; stateless apart from the generator for unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded rows draw from this (None = torch's default generator for the device).
        self.generator = generator
        # One reusable generator per device for seeded rows: manual_seed resets it completely,
        # so reuse is equivalent to make_generator() without an allocation per row and step.
        self._scratch: dict[torch.device, torch.Generator] = {}

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
        num_rows, vocab = logits.shape
        if not (len(params) == len(prompt_token_ids) == len(output_token_ids) == num_rows):
            raise ValueError(
                f"batch mismatch: {num_rows} logits rows, {len(params)} params, "
                f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs"
            )
        logits = logits.float()
        raw_logits = logits  # logprobs describe the model, so keep the unpenalized logits

        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if pen_rows:
            logits = _apply_penalties_to_rows(
                logits, pen_rows, params, prompt_token_ids, output_token_ids
            )

        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if bias_rows:
            logits = _apply_logit_bias(logits, bias_rows, params)

        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        steps = [len(output_token_ids[i]) for i in rand_rows]
        if not rand_rows:
            token_ids = logits.argmax(dim=-1)  # fast path: every row greedy
        elif len(rand_rows) == num_rows:
            token_ids = self._sample_random(logits, list(params), steps)
        else:
            idx = torch.tensor(rand_rows, device=logits.device)
            rand_params = [params[i] for i in rand_rows]
            sampled = self._sample_random(logits.index_select(0, idx), rand_params, steps)
            token_ids = logits.argmax(dim=-1).index_copy(0, idx, sampled)

        tokens = token_ids.tolist()
        return SamplerOutput(token_ids=tokens, logprobs=_logprobs(raw_logits, params, tokens))

    def _sample_random(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        """Temperature, filtering and the exponential race on non-greedy rows ([r, vocab])."""
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)

        vocab = logits.shape[1]
        top_k = None
        if any(p.uses_top_k for p in params):
            ks = [min(p.top_k, vocab) if p.uses_top_k else vocab for p in params]
            top_k = torch.tensor(ks, device=device)
        top_p = None
        if any(p.uses_top_p for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.uses_min_p for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
            logits = apply_min_p(logits, min_p)

        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        unseeded = [j for j, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            q.exponential_(generator=self.generator)
        else:
            if unseeded:
                u_idx = torch.tensor(unseeded, device=device)
                noise = torch.empty((len(unseeded), vocab), device=device, dtype=q.dtype)
                q.index_copy_(0, u_idx, noise.exponential_(generator=self.generator))
            gen = self._scratch_generator(device)
            for j, p in enumerate(params):
                if p.seed is not None:
                    gen.manual_seed(derive_seed(p.seed, steps[j]))
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


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of `logits` ([r, vocab]); penalty tensors are [r].

    Repetition (CTRL paper, as vLLM/HF): tokens present in prompt or output have positive
    logits divided by the penalty and negative ones multiplied. Then OpenAI's frequency
    (per output occurrence) and presence (once if in the output) penalties are subtracted.
    """
    num_rows, vocab = logits.shape
    out_counts = _token_counts(output_token_ids, num_rows, vocab, logits.device)
    in_output = out_counts > 0
    seen = in_output | (_token_counts(prompt_token_ids, num_rows, vocab, logits.device) > 0)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency.unsqueeze(1) * out_counts
    return logits - presence.unsqueeze(1) * in_output.to(logits.dtype)


def _apply_penalties_to_rows(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Copy of `logits` with penalties applied to `rows` only (the others cost nothing)."""
    dev, dt = logits.device, logits.dtype
    idx = torch.tensor(rows, device=dev)
    penalized = apply_penalties(
        logits.index_select(0, idx),
        [prompt_token_ids[i] for i in rows],
        [output_token_ids[i] for i in rows],
        torch.tensor([params[i].presence_penalty for i in rows], device=dev, dtype=dt),
        torch.tensor([params[i].frequency_penalty for i in rows], device=dev, dtype=dt),
        torch.tensor([params[i].repetition_penalty for i in rows], device=dev, dtype=dt),
    )
    return logits.index_copy(0, idx, penalized)


def _apply_logit_bias(
    logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Copy of `logits` with each row's `logit_bias` added (ids were checked against the vocab
    when the request was added)."""
    flat_rows, flat_ids, values = [], [], []
    for i in rows:
        for token, bias in params[i].logit_bias.items():
            flat_rows.append(i)
            flat_ids.append(token)
            values.append(bias)
    dev = logits.device
    out = logits.clone()
    out.index_put_(
        (torch.tensor(flat_rows, device=dev), torch.tensor(flat_ids, device=dev)),
        torch.tensor(values, device=dev, dtype=logits.dtype),
        accumulate=True,
    )
    return out


def _token_counts(
    token_ids: Sequence[Sequence[int]], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab] float counts of each token id per row (one scatter_add for all rows)."""
    width = max((len(t) for t in token_ids), default=0)
    counts = torch.zeros((num_rows, vocab + 1), dtype=torch.float32, device=device)
    if width:
        # Pad with the extra column `vocab`, which is dropped below.
        padded = [list(t) + [vocab] * (width - len(t)) for t in token_ids]
        index = torch.tensor(padded, dtype=torch.long, device=device)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
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


def _logprobs(
    raw_logits: torch.Tensor, params: Sequence[SamplingParams], tokens: list[int]
) -> list[list[tuple[int, float]] | None]:
    """Per row: None, or [(sampled, lp), *top-N] from log_softmax of the raw logits."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[list[tuple[int, float]] | None] = [None] * len(params)
    if not rows:
        return out
    idx = torch.tensor(rows, device=raw_logits.device)
    logprobs = raw_logits.index_select(0, idx).log_softmax(dim=-1)
    sampled = torch.tensor([tokens[i] for i in rows], device=raw_logits.device)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    n_max = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = logprobs.topk(n_max, dim=-1) if n_max else (None, None)
    top_vals_l = top_vals.tolist() if top_vals is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    for j, i in enumerate(rows):
        entry = [(tokens[i], sampled_lp[j])]
        n = params[i].logprobs or 0
        if n:
            entry.extend(zip(top_ids_l[j][:n], top_vals_l[j][:n]))
        out[i] = entry
    return out
