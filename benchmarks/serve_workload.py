"""Workloads for `fairbatch bench serve`: when requests arrive, how long they are, who sends them.

Everything is seeded: the same arguments give the same `list[RequestSpec]`, byte for byte, on any
machine with the same Python. Only `random.Random` is used (string seeds included, which hash
with SHA-512, not `hash()`): Python promises its `random()` stream across versions; the
distributions built on it (choice, gammavariate, ...) have long been stable but are not promised.

Four pieces:
  * `arrival_times`: Poisson or gamma (bursty) inter-arrival gaps, or everything at once.
  * `LengthDist` / `parse_lengths`: prompt and output lengths ("fixed:N", "uniform:LO-HI",
    "lognormal:MEAN,SIGMA[,MAX]"), plus `sharegpt_lengths`, a ShareGPT-shaped pair.
  * `TextMaker`: prompt text of about N tokens.
  * `build_workload`: the above, for one or more tenants, optionally with shared system prompts.

Named scenarios built from these (the VTC paper's fairness experiments and a few of our own)
are in `serve_scenarios.py`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from fairbatch.benchmarks.serve_types import RequestSpec

PROCESSES = ("poisson", "gamma", "all-at-once")
DEFAULT_MAX_LEN = 1024  # lognormal clip: prompt + output of two maxima fit max_model_len 2048
PROMPT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # VTC cost weights (Sheng et al. §4), as in metrics


# -- arrivals ---------------------------------------------------------------------------------


def arrival_times(
    n: int,
    rate: float,
    process: str = "poisson",
    *,
    burstiness: float = 1.0,
    rng: random.Random,
) -> list[float]:
    """`n` sorted arrival offsets in seconds; the first is one gap after 0 (a renewal process
    started at 0), except "all-at-once", where all are 0.0 and `rate` is ignored.

    "poisson": exponential gaps with mean 1/rate. "gamma": gamma gaps with shape=burstiness and
    scale=1/(rate*burstiness), so the mean gap is still 1/rate and the gaps' coefficient of
    variation is 1/sqrt(burstiness): < 1 is burstier than Poisson, 1 is Poisson (vLLM's
    `benchmark_serving --burstiness`). Raises ValueError on n < 0, an unknown process,
    rate <= 0 (poisson, gamma), burstiness <= 0, or burstiness != 1 with "poisson".
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    next_gap = gap_sampler(rate, process, burstiness, rng)
    offsets, t = [], 0.0
    for _ in range(n):
        t += next_gap()
        offsets.append(t)
    return offsets


def gap_sampler(
    rate: float, process: str, burstiness: float, rng: random.Random
) -> Callable[[], float]:
    if process not in PROCESSES:
        raise ValueError(f"unknown arrival process {process!r}; choose from {PROCESSES}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if process == "all-at-once":
        return lambda: 0.0
    if not rate > 0:
        raise ValueError(f"rate must be > 0 for {process!r} arrivals, got {rate}")
    if process == "poisson":
        if burstiness != 1.0:
            raise ValueError("burstiness applies to process='gamma' (poisson is burstiness 1)")
        return lambda: rng.expovariate(rate)
    return lambda: rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


# -- lengths ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts: samples are integers in [lo, hi].

    kind "fixed" (lo == hi), "uniform" (inclusive), or "lognormal": exp(N(mu, sigma^2)) with
    mu chosen so the *unclipped* mean is `log_mean`, rounded to the nearest integer and clipped
    to [lo, hi] = [1, max]. `.mean` is the exact expected value of what `sample` returns.
    """

    kind: str
    lo: int
    hi: int
    log_mean: float = 0.0  # lognormal only: mean before rounding and clipping
    sigma: float = 0.0  # lognormal only: sigma of the underlying normal

    @staticmethod
    def fixed(n: int) -> LengthDist:
        if n < 1:
            raise ValueError(f"fixed length must be >= 1, got {n}")
        return LengthDist("fixed", n, n)

    @staticmethod
    def uniform(lo: int, hi: int) -> LengthDist:
        if not 1 <= lo <= hi:
            raise ValueError(f"uniform lengths need 1 <= LO <= HI, got {lo}-{hi}")
        return LengthDist("uniform", lo, hi)

    @staticmethod
    def lognormal(mean: float, sigma: float, max_len: int = DEFAULT_MAX_LEN) -> LengthDist:
        if not (mean > 0 and sigma >= 0 and max_len >= 1):
            raise ValueError(f"lognormal needs MEAN > 0, SIGMA >= 0, MAX >= 1: {mean, sigma}")
        return LengthDist("lognormal", 1, int(max_len), float(mean), float(sigma))

    def sample(self, rng: random.Random) -> int:
        """One length, drawn from `rng`."""
        if self.kind == "fixed":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        x = rng.lognormvariate(self._mu, self.sigma)
        return min(self.hi, max(self.lo, int(x + 0.5)))

    @cached_property
    def mean(self) -> float:
        """E[sample()], exact (for lognormal: a sum over the integers of [lo, hi])."""
        if self.kind != "lognormal":
            return (self.lo + self.hi) / 2
        if self.sigma == 0:
            return float(min(self.hi, max(self.lo, int(self.log_mean + 0.5))))
        # P(sample <= k) = P(X < k + 0.5) for lo <= k < hi; the clip puts the tails on lo and hi.
        # A tail below 1e-12 is put on hi too (error < hi * 1e-12): a huge clip costs nothing.
        cdf_prev, total = 0.0, 0.0
        for k in range(self.lo, self.hi):
            cdf = self._cdf(k + 0.5)
            total += k * (cdf - cdf_prev)
            cdf_prev = cdf
            if 1.0 - cdf < 1e-12:
                break
        return total + self.hi * (1.0 - cdf_prev)

    def scaled(self, factor: float) -> LengthDist:
        """The same shape with lengths (and the clip) multiplied by `factor` (each >= 1)."""
        lo, hi = (max(1, round(x * factor)) for x in (self.lo, self.hi))
        if self.kind == "fixed":
            return LengthDist.fixed(lo)
        if self.kind == "uniform":
            return LengthDist.uniform(lo, hi)
        return LengthDist.lognormal(self.log_mean * factor, self.sigma, hi)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.lo}"
        if self.kind == "uniform":
            return f"uniform:{self.lo}-{self.hi}"
        return f"lognormal:{self.log_mean:g},{self.sigma:g},{self.hi}"

    @property
    def _mu(self) -> float:
        return math.log(self.log_mean) - self.sigma**2 / 2

    def _cdf(self, x: float) -> float:
        z = (math.log(x) - self._mu) / self.sigma
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def parse_lengths(spec: str, *, max_len: int = DEFAULT_MAX_LEN) -> LengthDist:
    """Parse "fixed:N", "uniform:LO-HI" (inclusive) or "lognormal:MEAN,SIGMA[,MAX]" (MEAN in
    tokens, SIGMA of the underlying normal, clipped to [1, MAX], MAX defaulting to `max_len`).
    Raises ValueError on anything else."""
    kind, _, args = spec.strip().partition(":")
    try:
        if kind == "fixed":
            return LengthDist.fixed(int(args))
        if kind == "uniform":
            lo, hi = args.split("-")
            return LengthDist.uniform(int(lo), int(hi))
        if kind == "lognormal":
            parts = args.split(",")
            if len(parts) not in (2, 3):
                raise ValueError("expected MEAN,SIGMA[,MAX]")
            clip = int(parts[2]) if len(parts) == 3 else max_len
            return LengthDist.lognormal(float(parts[0]), float(parts[1]), clip)
    except ValueError as e:
        raise ValueError(f"bad length spec {spec!r}: {e}") from None
    raise ValueError(
        f"bad length spec {spec!r}: use fixed:N, uniform:LO-HI or lognormal:MEAN,SIGMA"
    )


SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 161, 338
SHAREGPT_SIGMA = 1.0


def sharegpt_lengths(
    scale: float = 1.0, max_len: int = DEFAULT_MAX_LEN
) -> tuple[LengthDist, LengthDist]:
    """(prompt, output) lognormals shaped like ShareGPT conversations, means times `scale`.

    The means, 161 input and 338 output tokens, are the ShareGPT statistics reported by the
    vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
    PagedAttention", SOSP 2023, §6.1, Fig. 11); they come from the paper, not from a dataset we
    ship or read. The lognormal shape and sigma = 1.0 are our choice (ShareGPT's lengths are
    right-skewed with a long tail). Both are clipped to [1, max_len], which lowers `.mean`
    slightly below the scaled paper means. The tiny CPU model wants scale ~0.25.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return (
        LengthDist.lognormal(SHAREGPT_MEAN_INPUT * scale, SHAREGPT_SIGMA, max_len),
        LengthDist.lognormal(SHAREGPT_MEAN_OUTPUT * scale, SHAREGPT_SIGMA, max_len),
    )


SHAREGPT_LIKE: tuple[LengthDist, LengthDist] = sharegpt_lengths()


def base_lengths(scale: float = 1.0) -> tuple[LengthDist, LengthDist]:
    """(prompt, output) lengths the scenarios' loads are relative to: measure `capacity_rps`
    with these. Prompts ~40-190 tokens (5th-95th percentile), outputs ~25-128, at scale 1."""
    return (
        LengthDist.lognormal(96, 0.5, 256).scaled(scale),
        LengthDist.lognormal(64, 0.5, 128).scaled(scale),
    )


def mean_cost(input_lens: LengthDist, output_lens: LengthDist) -> float:
    """Expected VTC cost (weighted tokens) of one request with these lengths."""
    return PROMPT_WEIGHT * input_lens.mean + OUTPUT_WEIGHT * output_lens.mean


# -- text -------------------------------------------------------------------------------------

# Common English words, each exactly one token (with its leading space) in fairbatch's tiny
# tokenizer (a unit test checks this) and in the large BPE vocabularies of Llama-family models.
DEFAULT_WORDS = tuple(
    """about after again against also another answer because before between both build
    cache called came check class client code come could count different each room
    engine enough error every exactly fast first five follow forward four free from full
    give good group half hand hard have hold idea input into just keep know large last
    learn length like line list little load long make many model more most much must
    name never next nothing number object once only order other output over pair part
    pass past piece plain plus took possible problem process question queue random rate
    read real reason request result return same second send server service share short
    should show side simple single size small some soon start still stop store stream
    system table take text than that their them then there they third this three through
    time together turn usual until used user value very wait what when where which while
    whole with without words work would write""".split()
)


class TextMaker:
    """Deterministic filler text of about `n_tokens` tokens: words drawn from `rng`.

    `tokens_per_word` converts tokens to words. With the default words it is 1.0 and exact:
    on the tiny tokenizer, `make(n)` encodes to exactly n tokens (BOS and other special tokens
    the server adds not counted). Large Llama-style vocabularies also hold these words whole; a
    SentencePiece tokenizer may add one token for the leading space. For other words, measure
    the ratio once with `calibrate`.
    """

    def __init__(self, vocab_words: list[str] | None = None, tokens_per_word: float = 1.0) -> None:
        words = list(DEFAULT_WORDS if vocab_words is None else vocab_words)
        if not words or not tokens_per_word > 0:
            raise ValueError("TextMaker needs at least one word and tokens_per_word > 0")
        self.words = words
        self.tokens_per_word = tokens_per_word

    def make(self, n_tokens: int, rng: random.Random) -> str:
        """At least one word, each preceded by a space. The leading space keeps the first word
        one token too, and makes texts concatenate into a prompt whose tokens are the parts'."""
        n_words = max(1, round(n_tokens / self.tokens_per_word))
        return "".join(" " + rng.choice(self.words) for _ in range(n_words))

    def calibrate(self, encode: Callable[[str], list[int]], n_words: int = 2000) -> float:
        """Set and return `tokens_per_word` as measured with `encode` (no special tokens) on a
        fixed sample of `n_words` words. Any tokenizer's encode works; nothing is imported."""
        rng = random.Random(0)
        text = "".join(" " + rng.choice(self.words) for _ in range(n_words))
        self.tokens_per_word = len(encode(text)) / n_words
        return self.tokens_per_word


# -- workloads --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantPlan:
    """A tenant as the harness configures it on the server (and as the workload sends)."""

    name: str
    weight: float = 1.0  # fair-share weight
    priority: int = 0  # higher runs first (sent on each request as `priority`)
    tokens_per_minute: float | None = None  # token-bucket quota; None = unlimited


def build_workload(
    num_requests: int,
    *,
    rate: float,
    process: str = "poisson",
    burstiness: float = 1.0,
    input_lens: LengthDist,
    output_lens: LengthDist,
    tenants: list[TenantPlan] | None = None,
    shared_prefix: tuple[int, int] | None = None,
    prefix_hot: dict[str, float] | None = None,
    seed: int = 0,
    start_s: float = 0.0,
    text: TextMaker | None = None,
) -> list[RequestSpec]:
    """`num_requests` requests arriving at `rate` (all tenants together) from `start_s` on.

    Tenants are assigned by smooth weighted round robin (nginx's: deterministic, and every
    prefix of the list is within one request of the weights' proportions), so a tenant's
    offered load is proportional to its weight. Default: one tenant named "default".

    `shared_prefix=(groups, prefix_len)`: each tenant has `groups` system prompts of
    `prefix_len` tokens, ids "<tenant>/<g>"; each request starts with one of its tenant's,
    chosen by the rng, then a unique suffix of `input_lens` tokens, so
    prompt_len = prefix_len + suffix (as vLLM's random dataset with a prefix does).
    `prefix_hot`: tenant -> the share of its requests that start with its first system prompt
    (the others pick uniformly among all of its prompts); default: all uniformly.
    """
    rng = random.Random(seed)
    offsets = arrival_times(num_requests, rate, process, burstiness=burstiness, rng=rng)
    plans = tenants if tenants is not None else [TenantPlan("default")]
    names = _weighted_round_robin(plans, num_requests)
    by_name = {p.name: p for p in plans}
    maker = text or TextMaker()
    prefixes = prefix_texts(plans, shared_prefix, seed, maker)
    hot = prefix_hot or {}
    lens = (input_lens, output_lens)
    return [
        make_request(i, by_name[name], start_s + t, *lens, prefixes, rng, maker, hot.get(name, 0))
        for i, (t, name) in enumerate(zip(offsets, names))
    ]


def _weighted_round_robin(plans: list[TenantPlan], n: int) -> list[str]:
    if not plans or any(not p.weight > 0 for p in plans):
        raise ValueError("need at least one tenant, all with weight > 0")
    total = sum(p.weight for p in plans)
    current = [0.0] * len(plans)
    order = []
    for _ in range(n):
        current = [c + p.weight for c, p in zip(current, plans)]
        best = max(range(len(plans)), key=lambda k: current[k])  # first max: stable ties
        current[best] -= total
        order.append(plans[best].name)
    return order


def prefix_texts(
    plans: list[TenantPlan], shared_prefix: tuple[int, int] | None, seed: int, maker: TextMaker
) -> dict[str, list[tuple[str, str, int]]]:
    """tenant -> [(group id, prefix text, prefix_len)]; empty lists without shared prefixes."""
    if shared_prefix is None:
        return {p.name: [] for p in plans}
    groups, length = shared_prefix
    if groups < 1 or length < 1:
        raise ValueError(f"shared_prefix needs groups >= 1 and length >= 1, got {shared_prefix}")
    return {
        p.name: [
            (f"{p.name}/{g}", maker.make(length, random.Random(f"{seed}:{p.name}:{g}")), length)
            for g in range(groups)
        ]
        for p in plans
    }


def make_request(
    index: int,
    plan: TenantPlan,
    arrival_s: float,
    input_lens: LengthDist,
    output_lens: LengthDist,
    prefixes: dict[str, list[tuple[str, str, int]]],
    rng: random.Random,
    maker: TextMaker,
    hot: float = 0.0,
) -> RequestSpec:
    suffix_len = input_lens.sample(rng)
    max_tokens = output_lens.sample(rng)
    group, prompt, prompt_len = None, maker.make(suffix_len, rng), suffix_len
    if prefixes[plan.name]:
        mine = prefixes[plan.name]
        # (no draw without a hot share: the same seed gives the same requests as before)
        first = hot > 0 and rng.random() < hot
        group, prefix, prefix_len = mine[0] if first else rng.choice(mine)
        prompt, prompt_len = prefix + prompt, prefix_len + suffix_len
    return RequestSpec(
        index=index,
        tenant=plan.name,
        arrival_s=arrival_s,
        prompt=prompt,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        priority=plan.priority,
        shared_prefix=group,
    )
