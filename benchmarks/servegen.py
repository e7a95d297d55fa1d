"""Real tenants for `fairbatch bench serve --workload servegen`: ServeGen's per-client data.

ServeGen (Xiang et al., "ServeGen: Workload Characterization of Large Language Model Serving
in Production", arXiv 2505.09999) publishes, per client of Alibaba Cloud Model Studio, 14 days
of 10-minute windows. A client directory holds, for each client N:

* `chunk-N-trace.csv`, one row per window, no header:
  `window_start_s, rate_req_s, cv, pattern, shape, scale`; `pattern` is the inter-arrival
  distribution, "Gamma" (shape k, scale theta) or "Weibull" (shape k, scale lambda); a window
  with rate 0 has an empty pattern.
* `chunk-N-dataset.json`: `{window_start_s: {"input_tokens": PDF, "output_tokens": PDF}}`, each
  PDF the text of a Python dict `{token_count: probability}`; a window takes the latest
  non-empty entry at or before its start (else the first non-empty one after it).

A replay makes each client a tenant. Per window it draws inter-arrival gaps from the window's
pattern, rescaled so their mean is 1 / (the window's rate x `rate_scale`): the pattern keeps the
client's burstiness (its CV), the rate says how many. This is how ServeGen's own generator
builds a workload. Windows are compressed by `time_scale`: a 600 s window lasts
600 / time_scale seconds of the replay. `rate_scale` is chosen by the bench so that the whole
mix offers a given multiple of the server's measured capacity. Lengths come from the window's
PDFs, capped to what the model and this machine run (`LengthCaps`).

Everything is seeded by strings (`random.Random` hashes them with SHA-512): the same directory,
span, clients and seed give the same requests on any machine.
"""

from __future__ import annotations

import ast
import bisect
import csv
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from fairbatch.benchmarks.serve_types import RequestSpec
from fairbatch.benchmarks.serve_workload import OUTPUT_WEIGHT, PROMPT_WEIGHT, TextMaker

WINDOW_S = 600.0  # ServeGen's window length
PATTERNS = ("Gamma", "Weibull")


@dataclass(frozen=True)
class Window:
    """One 10-minute window of a client: its rate and inter-arrival pattern."""

    start_s: float
    rate: float  # requests per second (0: the client sent nothing)
    cv: float  # coefficient of variation of the inter-arrival gaps
    pattern: str  # "Gamma", "Weibull", or "" when rate is 0
    shape: float
    scale: float

    def gap_sampler(self, rate: float, rng: random.Random):
        """A function drawing gaps of this window's pattern with mean 1 / `rate`."""
        if self.pattern == "Gamma" and self.shape > 0:
            mean = self.shape * self.scale
            return lambda: rng.gammavariate(self.shape, self.scale) / (mean * rate)
        if self.pattern == "Weibull" and self.shape > 0:
            mean = self.scale * math.gamma(1.0 + 1.0 / self.shape)
            return lambda: rng.weibullvariate(self.scale, self.shape) / (mean * rate)
        return lambda: rng.expovariate(rate)  # no fitted pattern: Poisson


@dataclass(frozen=True)
class LengthPdf:
    """A discrete distribution of token counts (a ServeGen PDF)."""

    values: tuple[int, ...]  # sorted token counts
    cdf: tuple[float, ...]  # cumulative probabilities, the last 1.0

    @staticmethod
    def parse(text: str) -> LengthPdf | None:
        """From the text of a `{token_count: probability}` dict; None for an empty one."""
        pdf = ast.literal_eval(text) if text.strip() else {}
        if not isinstance(pdf, dict):
            raise ValueError(f"a length PDF must be a dict, got {type(pdf).__name__}")
        items = sorted((int(k), float(p)) for k, p in pdf.items() if float(p) > 0)
        total = sum(p for _, p in items)
        if not items:
            return None
        cum, acc = [], 0.0
        for _, p in items:
            acc += p / total
            cum.append(acc)
        cum[-1] = 1.0
        return LengthPdf(tuple(v for v, _ in items), tuple(cum))

    def sample(self, rng: random.Random) -> int:
        return self.values[bisect.bisect_left(self.cdf, rng.random())]

    def mean(self, cap: int | None = None) -> float:
        """E[min(sample, cap)]."""
        prev, total = 0.0, 0.0
        for v, c in zip(self.values, self.cdf):
            total += (v if cap is None else min(v, cap)) * (c - prev)
            prev = c
        return total


@dataclass
class Client:
    """One ServeGen client: its windows and its length PDFs by window start."""

    name: str
    windows: list[Window]
    lengths: dict[float, tuple[LengthPdf, LengthPdf]]  # non-empty entries only
    _starts: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._starts = sorted(self.lengths)

    def lengths_at(self, t: float) -> tuple[LengthPdf, LengthPdf]:
        """The (input, output) PDFs a window starting at `t` uses."""
        if not self._starts:
            raise ValueError(f"client {self.name} has no length data")
        k = bisect.bisect_right(self._starts, t) - 1
        return self.lengths[self._starts[max(k, 0)]]

    def requests_in(self, span: range) -> float:
        """Expected requests over the windows `span` (indices)."""
        return sum(self.windows[w].rate * WINDOW_S for w in span)

    def cost_in(self, span: range, caps: LengthCaps) -> float:
        """Expected VTC cost (prompt + 2 x output tokens, capped) over the windows `span`."""
        total = 0.0
        for w in span:
            win = self.windows[w]
            if win.rate > 0:
                inp, out = self.lengths_at(win.start_s)
                unit = PROMPT_WEIGHT * inp.mean(caps.input) + OUTPUT_WEIGHT * out.mean(caps.output)
                total += win.rate * WINDOW_S * unit
        return total


@dataclass(frozen=True)
class LengthCaps:
    """The most prompt and output tokens a replayed request asks for. Longer draws are cut to
    these, so the replay runs on the model (its context) and on the machine (2 CPU cores
    prefill a few thousand tokens a second)."""

    input: int = 1024
    output: int = 256


def load_clients(directory: str | Path) -> dict[str, Client]:
    """Every client of a ServeGen directory, by name ("chunk-N"). Clients without any length
    data are left out (they cannot be replayed). Raises ValueError naming the file and row of
    anything malformed, FileNotFoundError when the directory holds no trace."""
    root = Path(directory)
    traces = sorted(root.glob("chunk-*-trace.csv"), key=_chunk_number)
    if not traces:
        raise FileNotFoundError(f"{root}: no chunk-N-trace.csv files (a ServeGen client dir?)")
    clients = {}
    for trace in traces:
        name = trace.name.removesuffix("-trace.csv")
        dataset = root / f"{name}-dataset.json"
        if not dataset.exists():
            raise ValueError(f"{trace}: no {dataset.name} beside it")
        lengths = _read_dataset(dataset)
        if lengths:
            clients[name] = Client(name, _read_trace(trace), lengths)
    return clients


def _chunk_number(path: Path) -> int:
    return int(path.name.split("-")[1])


def _read_trace(path: Path) -> list[Window]:
    windows = []
    with path.open(newline="") as f:
        for line_no, row in enumerate(csv.reader(f), 1):
            try:
                start, rate, cv, pattern, shape, scale = row
                rate_f = float(rate)
                if pattern not in PATTERNS + ("",) or rate_f < 0:
                    raise ValueError(f"bad pattern {pattern!r} or rate {rate!r}")
                windows.append(
                    Window(
                        float(start),
                        rate_f,
                        float(cv or 0),
                        pattern,
                        float(shape or 0),
                        float(scale or 0),
                    )
                )
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: {e}") from None
    if [w.start_s for w in windows] != sorted(w.start_s for w in windows):
        raise ValueError(f"{path}: windows are not in time order")
    return windows


def _read_dataset(path: Path) -> dict[float, tuple[LengthPdf, LengthPdf]]:
    try:
        data = json.loads(path.read_text())
        out = {}
        for start, entry in data.items():
            inp = LengthPdf.parse(entry["input_tokens"])
            outp = LengthPdf.parse(entry["output_tokens"])
            if inp is not None and outp is not None:
                out[float(start)] = (inp, outp)
        return out
    except (ValueError, KeyError, SyntaxError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from None


# -- choosing the tenants ------------------------------------------------------------------------


def busiest_span(clients: dict[str, Client], windows: int, caps: LengthCaps) -> range:
    """The `windows` consecutive windows with the most offered cost, all clients together."""
    n = min(len(c.windows) for c in clients.values())
    if not 1 <= windows <= n:
        raise ValueError(f"a span of {windows} windows does not fit {n}")
    per = [sum(c.cost_in(range(w, w + 1), caps) for c in clients.values()) for w in range(n)]
    totals = [sum(per[w : w + windows]) for w in range(n - windows + 1)]
    start = max(range(len(totals)), key=lambda w: totals[w])  # first maximum: deterministic
    return range(start, start + windows)


def pick_clients(
    clients: dict[str, Client],
    span: range,
    caps: LengthCaps,
    *,
    heavy: int = 3,
    tail: int = 5,
    seed: int = 0,
    min_share: float = 0.005,
) -> tuple[list[str], list[str]]:
    """(heavy, tail): the `heavy` clients offering the most cost over `span`, and `tail` drawn
    at random (seeded) from the other clients that sent at least `min_share` of all clients'
    requests in it (a replay of a few minutes gives rarer clients no request to measure).
    Raises ValueError when fewer qualify than asked for."""
    total = sum(c.requests_in(span) for c in clients.values())
    active = sorted(
        (n for n, c in clients.items() if total and c.requests_in(span) >= min_share * total),
        key=_name_order,
    )
    if len(active) < heavy + tail:
        raise ValueError(
            f"{len(active)} clients sent >= {min_share:.1%} of the requests in windows "
            f"{span.start}-{span.stop - 1}; "
            f"asked for {heavy} heavy + {tail} tail"
        )
    ranked = sorted(active, key=lambda n: (-clients[n].cost_in(span, caps), _name_order(n)))
    top = ranked[:heavy]
    rest = [n for n in active if n not in top]
    drawn = sorted(random.Random(f"servegen-tail:{seed}").sample(rest, tail), key=_name_order)
    return top, drawn


def _name_order(name: str) -> tuple[int, str]:
    parts = name.split("-")
    return (int(parts[1]), name) if len(parts) > 1 and parts[1].isdigit() else (1 << 30, name)


# -- the replay ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    """Which clients, which windows, how compressed and how loaded."""

    clients: tuple[str, ...]
    span: range
    time_scale: float  # replay seconds = trace seconds / time_scale
    rate_scale: float  # replay rate = trace rate x rate_scale (per replay second)
    caps: LengthCaps = LengthCaps()
    seed: int | str = 0

    @property
    def duration_s(self) -> float:
        return len(self.span) * WINDOW_S / self.time_scale


def offered_cost_per_s(clients: dict[str, Client], replay: Replay) -> float:
    """The replay's expected VTC cost per replay second, all its tenants together."""
    cost = sum(clients[n].cost_in(replay.span, replay.caps) for n in replay.clients)
    return cost * replay.rate_scale / (len(replay.span) * WINDOW_S)


def sample_client(
    client: Client, replay: Replay, maker: TextMaker | None = None, with_text: bool = True
) -> list[RequestSpec]:
    """One client's requests of the replay, as tenant `client.name`, sorted by arrival; indices
    are provisional (`build_replay` numbers the merged list). `with_text=False`: prompts are
    left empty (a simulation needs only their lengths; the draws then differ)."""
    maker = maker or TextMaker()
    rng = random.Random(f"servegen:{replay.seed}:{client.name}")
    window_len = WINDOW_S / replay.time_scale
    specs = []
    for k, w in enumerate(replay.span):
        win = client.windows[w]
        rate = win.rate * replay.rate_scale
        if rate <= 0:
            continue
        inp, out = client.lengths_at(win.start_s)
        t0, t = k * window_len, 0.0
        next_gap = win.gap_sampler(rate, rng)
        while (t := t + next_gap()) < window_len:
            n_in = min(inp.sample(rng), replay.caps.input)
            n_out = max(1, min(out.sample(rng), replay.caps.output))
            specs.append(
                RequestSpec(
                    index=0,
                    tenant=client.name,
                    arrival_s=t0 + t,
                    prompt=maker.make(n_in, rng) if with_text else "",
                    prompt_len=max(1, n_in),
                    max_tokens=n_out,
                )
            )
    return specs


def build_replay(
    clients: dict[str, Client],
    replay: Replay,
    maker: TextMaker | None = None,
    with_text: bool = True,
) -> list[RequestSpec]:
    """All tenants' requests, sorted by arrival (ties by tenant), numbered 0..n-1."""
    import dataclasses

    specs = [s for n in replay.clients for s in sample_client(clients[n], replay, maker, with_text)]
    specs.sort(key=lambda s: (s.arrival_s, s.tenant))
    return [dataclasses.replace(s, index=i) for i, s in enumerate(specs)]
