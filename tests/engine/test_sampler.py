"""SamplingParams validation and the Sampler: penalties, filters, seeding contract, logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fairbatch.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k_top_p,
    derive_seed,
    make_generator,
)
from fairbatch.engine.sampling_params import SamplingParams

NEG_INF = -float("inf")

# -- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": "7"}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_valid_edges_and_normalization() -> None:
    p = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0, logprobs=20,
        stop="###", seed=-3,
    )  # fmt: skip
    assert p.stop == ["###"] and p.stop_token_ids == []
    assert p.is_greedy and not p.uses_top_k and not p.uses_top_p and p.uses_min_p
    assert p.has_penalties
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(5,)).stop == ["a", "b"]
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(temperature=7.5).temperature == 7.5  # no upper bound, as vLLM


# -- helpers ----------------------------------------------------------------------------------


def _sample(logits, params, prompts=None, outputs=None, sampler=None):
    n = len(params)
    prompts = prompts if prompts is not None else [[0]] * n
    outputs = outputs if outputs is not None else [[]] * n
    return (sampler or Sampler()).sample(logits, params, prompts, outputs)


def _reference_penalties(row, prompt, output, presence, frequency, repetition):
    """Per-token Python version of the vLLM/OpenAI penalty definitions."""
    row = list(row)
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t in set(output):
        row[t] -= frequency * output.count(t) + presence
    return row


# -- greedy and penalties ---------------------------------------------------------------------


def test_greedy_is_argmax_and_does_not_mutate_logits() -> None:
    logits = torch.randn(5, 33, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before)


def test_penalties_match_reference_definition() -> None:
    vocab = 12
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, vocab, generator=gen) * 3
    prompts = [[1, 2, 2, 3], [4], [0, 11]]
    outputs = [[3, 5, 5, 5, 6], [], [11, 7, 7]]
    settings = [(0.5, 0.3, 1.7), (1.0, 1.0, 0.6), (-0.7, 0.0, 1.0)]
    params = [
        SamplingParams(temperature=0, presence_penalty=p, frequency_penalty=f,
                       repetition_penalty=r)
        for p, f, r in settings
    ]  # fmt: skip
    from fairbatch.engine.sampler import _apply_penalties_to_rows, _penalty_inputs

    got = _apply_penalties_to_rows(logits, _penalty_inputs(params, prompts, outputs, vocab))
    for i, (p, f, r) in enumerate(settings):
        want = _reference_penalties(logits[i].tolist(), prompts[i], outputs[i], p, f, r)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_penalty_inputs_from_kept_prompt_rows_equal_the_lists() -> None:
    """The sampler keeps penalized prompts as arrays across steps (`IntRows`, by the list's
    id): over steps with growing outputs, a request that ends and new ones, the staged inputs
    equal those made from the lists, and the kept prompts stay bounded."""
    from fairbatch.engine.sampler import _penalty_inputs
    from fairbatch.engine.staging import IntRows

    rng = random.Random(3)
    vocab, kept = 50, IntRows()
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.2)] * 4
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    outputs = [[] for _ in range(4)]
    for step in range(300):
        if step % 3 == 0:  # one request ends, a new one takes its row
            i = rng.randrange(4)
            prompts[i] = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
            outputs[i] = []
        for out in outputs:
            out.append(rng.randrange(vocab))
        want = _penalty_inputs(params, prompts, outputs, vocab)
        got = _penalty_inputs(params, prompts, outputs, vocab, kept)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), (step, key)
        assert len(kept) <= 2 * 4 + 64 + 4


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.0]])
    # Token 0 was in the prompt: 2.0 / 2 = 1.0 < 1.5, so token 1 wins.
    out = _sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], [[0]], [[]])
    assert out.token_ids == [1]
    # Presence/frequency only look at the output: prompt token 0 stays the argmax.
    out = _sample(logits, [SamplingParams(temperature=0, presence_penalty=2.0)], [[0]], [[]])
    assert out.token_ids == [0]
    out = _sample(logits, [SamplingParams(temperature=0, presence_penalty=0.6)], [[3]], [[0]])
    assert out.token_ids == [1]


def test_penalty_rows_do_not_leak_into_other_rows() -> None:
    logits = torch.tensor([[3.0, 2.9], [3.0, 2.9]])
    params = [SamplingParams(temperature=0, frequency_penalty=1.0), SamplingParams(temperature=0)]
    out = _sample(logits, params, [[1], [1]], [[0], [0]])
    assert out.token_ids == [1, 0]


# -- filters ----------------------------------------------------------------------------------


def test_top_k_keeps_k_largest_with_ties() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 3.0], [1.0, 4.0, 3.0, 2.0, 0.0]])
    got = apply_top_k_top_p(logits, torch.tensor([2, 5]), None)
    assert got[0].tolist() == [NEG_INF, 4.0, 3.0, NEG_INF, 3.0]  # tie at the k-th value kept
    assert got[1].tolist() == logits[1].tolist()  # k = vocab is off


@pytest.mark.parametrize(
    ("p", "kept"),
    [(0.35, {0}), (0.5, {0, 1}), (0.7, {0, 1}), (0.75, {0, 1, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_with_mass_p(p: float, kept: set[int]) -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[[3, 0, 2, 1]].unsqueeze(0)  # shuffled: ids 1, 3, 2, 0 by prob
    got = apply_top_k_top_p(logits, None, torch.tensor([p]))[0]
    order = [1, 3, 2, 0]  # token id of the i-th most likely
    assert {i for i in range(4) if got[order[i]] > NEG_INF} == kept


def test_top_p_always_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 10.0, 0.0]])
    got = apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert got.tolist() == [[NEG_INF, 10.0, NEG_INF]]
    # Over a Llama-3-sized vocab the float32 cumulative sum stops short of 1 - 1e-7: without
    # a guard every token would be dropped.
    logits = torch.randn(1, 128_256, generator=torch.Generator().manual_seed(0))
    got = apply_top_k_top_p(logits, None, torch.tensor([1e-7]))
    assert (got > NEG_INF).nonzero().tolist() == [[0, int(logits.argmax())]]


def test_min_p_relative_to_max_prob() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    got = apply_min_p(probs.log(), torch.tensor([0.35]))  # threshold 0.175
    assert (got[0] > NEG_INF).tolist() == [True, True, False, False]
    assert torch.equal(apply_min_p(probs.log(), torch.tensor([0.0])), probs.log())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=2, seed=1),
        SamplingParams(top_p=0.5, seed=2),
        SamplingParams(min_p=0.5, seed=3),
    ],
)
def test_filtered_tokens_are_never_sampled(params: SamplingParams) -> None:
    # Token probs ~ [0.45, 0.4, 0.1, 0.05]: every filter above keeps only tokens 0 and 1.
    logits = torch.tensor([0.45, 0.4, 0.1, 0.05]).log().expand(400, 4)
    out = _sample(logits, [params] * 400, outputs=[[0] * i for i in range(400)])
    assert set(out.token_ids) == {0, 1}


def test_zero_exponential_draw_never_picks_a_filtered_token(monkeypatch) -> None:
    # Exp(1) draws can be exactly 0; unguarded, 0/0 = NaN and argmax picks the NaN.
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    logits = torch.tensor([[1.0, 2.0, 5.0, 0.0]])
    assert _sample(logits, [SamplingParams(top_k=1)]).token_ids == [2]
    assert _sample(logits, [SamplingParams(top_k=1, seed=5)]).token_ids == [2]


def test_sampling_follows_tempered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n, temp = 20000, 0.7
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    out = _sample(logits.expand(n, 4), [SamplingParams(temperature=temp)] * n, sampler=sampler)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    want = (logits / temp).softmax(dim=-1)
    assert freq.tolist() == pytest.approx(want.tolist(), abs=0.015)


# -- seeding contract -------------------------------------------------------------------------


def _fake_model_logits(tokens: list[int], vocab: int = 50) -> torch.Tensor:
    """Deterministic 'model': logits depend only on the sequence so far."""
    g = torch.Generator().manual_seed(hash(tuple(tokens)) & 0xFFFF_FFFF)
    return torch.randn(vocab, generator=g) * 2


def _generate(params: SamplingParams, prompt: list[int], steps: int, others: int) -> list[int]:
    """Generate `steps` tokens with `others` unseeded random rows around the request."""
    sampler = Sampler()
    out: list[int] = []
    for step in range(steps):
        rows = [_fake_model_logits(prompt + out)] + [torch.randn(50) for _ in range(others)]
        pos = step % (others + 1)  # move the request around inside the batch
        rows.insert(pos, rows.pop(0))
        plist = [SamplingParams(temperature=1.3)] * others
        plist.insert(pos, params)
        prompts, outputs = [[1]] * others, [[2] * step] * others
        prompts.insert(pos, prompt)
        outputs.insert(pos, out)
        out.append(sampler.sample(torch.stack(rows), plist, prompts, outputs).token_ids[pos])
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=42, temperature=1.5),
        SamplingParams(seed=7, top_k=10, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                       frequency_penalty=0.5),
    ],
)  # fmt: skip
def test_seeded_output_is_batch_independent(params: SamplingParams) -> None:
    alone = _generate(params, [3, 4, 5], steps=12, others=0)
    crowded = _generate(params, [3, 4, 5], steps=12, others=6)
    assert alone == crowded
    assert len(set(alone)) > 1  # actually random, not a constant


def test_seeded_output_resumes_from_any_step() -> None:
    """Preemption/migration: a fresh Sampler continuing from tokens so far gives the same."""
    params, prompt = SamplingParams(seed=99, temperature=1.0), [7, 8]
    full = _generate(params, prompt, steps=10, others=2)
    for cut in (1, 4, 9):
        out = list(full[:cut])
        for _ in range(10 - cut):
            logits = _fake_model_logits(prompt + out).unsqueeze(0)
            out.append(Sampler().sample(logits, [params], [prompt], [out]).token_ids[0])
        assert out == full


def test_seed_matters_and_step_matters() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the token is decided by the noise alone
    tok = [
        _sample(logits, [SamplingParams(seed=s)], outputs=[[0] * step]).token_ids[0]
        for s, step in [(1, 0), (1, 0), (2, 0), (1, 1)]
    ]
    assert tok[0] == tok[1] and len({tok[0], tok[2], tok[3]}) == 3


def test_sampler_draws_from_make_generator_stream() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    seed, step = 12345, 6
    got = _sample(logits, [SamplingParams(seed=seed)], outputs=[[0] * step]).token_ids[0]
    q = torch.empty(64).exponential_(generator=make_generator(seed, step))
    assert got == int((logits[0].softmax(-1) / q).argmax())
    assert make_generator(None, 0) is None


def test_derive_seed_mixes_and_fits_int63() -> None:
    seeds = {derive_seed(s, t) for s in (-1, 0, 1, 2**63 + 7) for t in range(50)}
    assert len(seeds) == 200
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(5, 3) == derive_seed(5, 3)


def test_unseeded_rows_use_the_samplers_generator() -> None:
    logits = torch.zeros(8, 1000)
    params = [SamplingParams()] * 8
    a = _sample(logits, params, sampler=Sampler(torch.Generator().manual_seed(0)))
    b = _sample(logits, params, sampler=Sampler(torch.Generator().manual_seed(0)))
    c = _sample(logits, params, sampler=Sampler(torch.Generator().manual_seed(1)))
    assert a.token_ids == b.token_ids != c.token_ids


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 2.0, seed=i, top_p=0.9, presence_penalty=1)
        for i in range(6)
    ]
    before = logits.clone()
    out = _sample(logits, params)
    assert torch.equal(logits, before)  # the random path works on copies too
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0, seed=i) for i in range(6)]
    out = _sample(logits, params)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


# -- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_model_logprobs_sampled_first() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = [
        # Penalties and temperature change the choice, not the reported logprobs.
        SamplingParams(temperature=0, repetition_penalty=10.0, logprobs=2),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = _sample(logits, params, prompts=[[1], [0]], outputs=[[], []])
    raw = logits.log_softmax(-1)
    tok0 = out.token_ids[0]
    assert tok0 == 3  # token 1 penalized 3.0 -> 0.3
    entry = out.logprobs[0]
    assert [t for t, _ in entry] == [3, 1, 3]
    assert [lp for _, lp in entry] == pytest.approx(raw[0, [3, 1, 3]].tolist())
    assert out.logprobs[1] == [(0, pytest.approx(math.log(0.2)))]


def test_logprobs_only_for_rows_that_ask() -> None:
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(logprobs=5, seed=1),
        SamplingParams(seed=2),
        SamplingParams(logprobs=1),
    ]
    out = _sample(logits, params)
    assert out.logprobs[1] is None
    assert len(out.logprobs[0]) == 6 and len(out.logprobs[2]) == 2
    top = [lp for _, lp in out.logprobs[0][1:]]
    assert top == sorted(top, reverse=True)


def test_batch_size_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="batch mismatch"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [[1]], [[]])
