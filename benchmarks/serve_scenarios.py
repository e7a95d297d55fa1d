"""Named, seeded multi-tenant scenarios for `fairbatch bench serve`, built from serve_workload.

Each reproduces a fairness experiment of the VTC paper (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024, §5) or one of our own. Rates are fractions of `capacity_rps`, the
request rate the server sustains on `base_lengths(scale)`, so each scenario is over- or
underloaded by design on any machine. Load is measured in VTC cost (prompt tokens + 2 x output
tokens, the paper's §4 weights), so a tenant with longer requests gets a proportionally lower
request rate for the same load.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

from fairbatch.benchmarks.serve_types import RequestSpec
from fairbatch.benchmarks.serve_workload import (
    OUTPUT_WEIGHT,
    PROMPT_WEIGHT,
    LengthDist,
    TenantPlan,
    TextMaker,
    base_lengths,
    gap_sampler,
    make_request,
    mean_cost,
    prefix_texts,
)


@dataclass
class Scenario:
    """A named, seeded multi-tenant workload and what a fair scheduler should show on it."""

    name: str
    description: str
    tenants: list[TenantPlan]
    requests: list[RequestSpec]  # sorted by arrival_s; requests[i].index == i
    duration_s: float  # arrivals lie in [0, duration_s)
    expect: str  # one sentence: what a fair scheduler should show (for the docs)
    capacity_rps: float = 0.0  # the capacity the rates were derived from
    unit_cost: float = 0.0  # VTC cost of one request of base_lengths(scale), on average

    def offered_load(
        self, tenant: str | None = None, t0: float = 0.0, t1: float | None = None
    ) -> float:
        """Offered VTC cost per second in [t0, t1) (default: the whole run), of `tenant` or of
        everyone, as a fraction of capacity (capacity_rps * unit_cost); uses max_tokens as the
        output length (ignore_eos)."""
        t1 = self.duration_s if t1 is None else t1
        cost = sum(
            PROMPT_WEIGHT * r.prompt_len + OUTPUT_WEIGHT * r.max_tokens
            for r in self.requests
            if t0 <= r.arrival_s < t1 and (tenant is None or r.tenant == tenant)
        )
        return cost / (t1 - t0) / (self.capacity_rps * self.unit_cost)


@dataclass
class _Ctx:
    """What scenario builders share: the run's shape and a stream maker."""

    name: str
    capacity_rps: float
    duration_s: float
    seed: int
    scale: float
    input_lens: LengthDist
    output_lens: LengthDist
    maker: TextMaker = dataclasses.field(default_factory=TextMaker)

    @property
    def unit_cost(self) -> float:
        return mean_cost(self.input_lens, self.output_lens)

    def stream(
        self,
        plan: TenantPlan,
        load: float,
        t0: float = 0.0,
        t1: float | None = None,
        *,
        length_factor: float = 1.0,
        shared_prefix: tuple[int, int] | None = None,
    ) -> list[RequestSpec]:
        """Poisson requests of `plan` in [t0, t1) offering `load` x capacity (in VTC cost),
        with base lengths times `length_factor`. Indices are provisional (set on merge)."""
        t1 = self.duration_s if t1 is None else t1
        inp, out = self.input_lens.scaled(length_factor), self.output_lens.scaled(length_factor)
        prefix_len = shared_prefix[1] if shared_prefix else 0
        cost = mean_cost(inp, out) + PROMPT_WEIGHT * prefix_len
        rate = load * self.capacity_rps * self.unit_cost / cost
        rng = random.Random(f"{self.name}:{self.seed}:{plan.name}:{t0}")
        prefixes = prefix_texts([plan], shared_prefix, self.seed, self.maker)
        next_gap, t, out_specs = gap_sampler(rate, "poisson", 1.0, rng), t0, []
        while (t := t + next_gap()) < t1:
            out_specs.append(make_request(0, plan, t, inp, out, prefixes, rng, self.maker))
        return out_specs


_Builder = Callable[[_Ctx], tuple[list[TenantPlan], list[RequestSpec]]]
_BUILDERS: dict[str, tuple[_Builder, str]] = {}  # name -> (builder, expect)
SCENARIOS: dict[str, str] = {}  # name -> one-line description


def _scenario(name: str, description: str, expect: str) -> Callable[[_Builder], _Builder]:
    def register(fn: _Builder) -> _Builder:
        _BUILDERS[name] = (fn, expect)
        SCENARIOS[name] = description
        return fn

    return register


def build_scenario(
    name: str, *, capacity_rps: float, duration_s: float = 60.0, seed: int = 0, scale: float = 1.0
) -> Scenario:
    """Build scenario `name` (see SCENARIOS) for a server that sustains `capacity_rps` requests
    per second of `base_lengths(scale)`. Same arguments, same Scenario. At scale 1 every prompt
    plus output fits the tiny model's 2048 positions; scale > 2 may not."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown scenario {name!r}; choose from {sorted(SCENARIOS)}")
    if not (capacity_rps > 0 and duration_s > 0 and scale > 0):
        raise ValueError("capacity_rps, duration_s and scale must be > 0")
    builder, expect = _BUILDERS[name]
    ctx = _Ctx(name, capacity_rps, duration_s, seed, scale, *base_lengths(scale))
    tenants, requests = builder(ctx)
    requests.sort(key=lambda r: (r.arrival_s, r.tenant))
    requests = [dataclasses.replace(r, index=i) for i, r in enumerate(requests)]
    desc = SCENARIOS[name]
    return Scenario(name, desc, tenants, requests, duration_s, expect, capacity_rps, ctx.unit_cost)


# Loads below are multiples of capacity, in VTC cost; "D" is duration_s. Sheng et al. §5 runs
# these shapes (overload, an under-share tenant, on/off, a length shift) on a real GPU; our
# multiples are chosen so each tenant is backlogged, or not, by construction.


@_scenario(
    "vtc_overload",
    "VTC §5: A offers 2x capacity, B 1x; both exceed their half share",
    "Both stay backlogged, so A and B get equal service (weighted tokens) although A sends twice "
    "as much, and their service difference stays under the VTC bound.",
)
def _vtc_overload(ctx: _Ctx):
    a, b = TenantPlan("A"), TenantPlan("B")
    return [a, b], ctx.stream(a, 2.0) + ctx.stream(b, 1.0)


@_scenario(
    "vtc_underload",
    "VTC §5: A offers 2x capacity, B 0.25x (half its fair share)",
    "B is served all it asks with near-idle latency while A, always backlogged, gets the rest: "
    "the scheduler is work-conserving and isolates B from A's overload.",
)
def _vtc_underload(ctx: _Ctx):
    a, b = TenantPlan("A"), TenantPlan("B")
    return [a, b], ctx.stream(a, 2.0) + ctx.stream(b, 0.25)


@_scenario(
    "vtc_on_off",
    "VTC §5: A offers 1.5x constantly; B 1.5x, on and off in turns of D/6",
    "While B is on the two split service equally, while it is off A gets it all, and B back "
    "from idle gets no catch-up burst (its counter is lifted): A's rate halves, never stops.",
)
def _vtc_on_off(ctx: _Ctx):
    a, b = TenantPlan("A"), TenantPlan("B")
    period = ctx.duration_s / 6
    b_on = [r for k in (0, 2, 4) for r in ctx.stream(b, 1.5, k * period, (k + 1) * period)]
    return [a, b], ctx.stream(a, 1.5) + b_on


@_scenario(
    "vtc_length_shift",
    "VTC §5: A offers 1.5x; B 1.5x, then its prompts and outputs double at D/2 (3x)",
    "Service in weighted tokens stays equal across the shift, and B's completed requests per "
    "second halve after it: fairness counts tokens, not requests.",
)
def _vtc_length_shift(ctx: _Ctx):
    a, b = TenantPlan("A"), TenantPlan("B")
    half = ctx.duration_s / 2
    # Same request rate after the shift with twice the tokens per request: load 3x.
    after = ctx.stream(b, 3.0, half, ctx.duration_s, length_factor=2.0)
    return [a, b], ctx.stream(a, 1.5) + ctx.stream(b, 1.5, 0.0, half) + after


@_scenario(
    "weighted",
    "three tenants with weights 1:2:4, each offering 1x capacity",
    "All three stay backlogged and are served in ratio 1:2:4: equal service per unit of weight, "
    "Jain's index near 1.",
)
def _weighted(ctx: _Ctx):
    plans = [TenantPlan(f"w{w}", weight=float(w)) for w in (1, 2, 4)]
    return plans, [r for p in plans for r in ctx.stream(p, 1.0)]


@_scenario(
    "priority_burst",
    "low priority offers 1.5x throughout; high priority 0.5x in [0.4D, 0.6D)",
    "High-priority requests keep near-idle TTFT during their burst (they go first and preempt), "
    "while low's service dips during the burst and recovers after it.",
)
def _priority_burst(ctx: _Ctx):
    low, high = TenantPlan("low", priority=0), TenantPlan("high", priority=1)
    d = ctx.duration_s
    return [low, high], ctx.stream(low, 1.5) + ctx.stream(high, 0.5, 0.4 * d, 0.6 * d)


@_scenario(
    "quota_limited",
    "capped offers 1x with tokens_per_minute 1/4 of what it sends; free offers 0.5x",
    "capped's served tokens (prompt + output) stay within its bucket, at most tokens_per_minute "
    "x (1 + minutes run) as the bucket starts full, the rest rejected or held back; free is "
    "served all it sends.",
)
def _quota_limited(ctx: _Ctx):
    # At load 1.0 with base lengths, capped sends capacity_rps requests per second.
    sent_per_min = ctx.capacity_rps * (ctx.input_lens.mean + ctx.output_lens.mean) * 60
    capped = TenantPlan("capped", tokens_per_minute=round(0.25 * sent_per_min, 1))
    free = TenantPlan("free")
    return [capped, free], ctx.stream(capped, 1.0) + ctx.stream(free, 0.5)


@_scenario(
    "shared_prefix",
    "4 tenants with 2 system prompts of 128 tokens each, 0.8x capacity in total (uncached)",
    "Each request after its group's first reuses the cached system prompt (server "
    "prefix_hit_tokens near prefix_len x repeats, in whole blocks, never across tenants), so "
    "TTFT is lower than for the same load without shared prefixes.",
)
def _shared_prefix(ctx: _Ctx):
    prefix = (2, max(1, round(128 * ctx.scale)))
    plans = [TenantPlan(f"t{k}") for k in range(4)]
    return plans, [r for p in plans for r in ctx.stream(p, 0.2, shared_prefix=prefix)]


# Deadlines in units of the time the server takes to finish one request at capacity (1 /
# capacity_rps): machine-independent, like the loads.
DEADLINE_UNITS = (32, 96)  # tight, loose: each request gets one of the two, half each


@_scenario(
    "deadlines",
    "A and B each offer 1x capacity (2x in all); every request has a timeout of 32 or 96 "
    "requests' time at capacity (half each) and max_queue_time_s half of it",
    "With deadlines enforced and edf, goodput (requests finished within their deadline per "
    "second) is >= 1.5x that of the same run without eviction, whose queue grows until most "
    "requests run after their deadline.",
)
def _deadlines(ctx: _Ctx):
    a, b = TenantPlan("A"), TenantPlan("B")
    rng = random.Random(f"{ctx.name}:{ctx.seed}:timeouts")
    requests = []
    for r in ctx.stream(a, 1.0) + ctx.stream(b, 1.0):
        timeout = round(rng.choice(DEADLINE_UNITS) / ctx.capacity_rps, 3)
        requests.append(dataclasses.replace(r, timeout=timeout, max_queue_time_s=timeout / 2))
    return [a, b], requests
