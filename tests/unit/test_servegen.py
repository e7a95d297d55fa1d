"""The ServeGen loader and replay sampler (benchmarks/servegen.py), on a fixture of two real
clients (tests/unit/fixtures/servegen: its README says what was cut) and hand-made files."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest

from fairbatch.benchmarks import servegen as sg

FIXTURE = Path(__file__).parent / "fixtures" / "servegen"


def _rows(name: str) -> list[list[str]]:
    with (FIXTURE / f"{name}-trace.csv").open() as f:
        return list(csv.reader(f))


def test_the_loader_reads_every_window_and_length_entry_of_the_fixture():
    clients = sg.load_clients(FIXTURE)
    assert sorted(clients) == ["chunk-18", "chunk-27"]
    for name, client in clients.items():
        rows = _rows(name)
        assert len(client.windows) == len(rows) == 12
        for w, row in zip(client.windows, rows):
            assert w.start_s == float(row[0]) and w.rate == float(row[1])
            assert w.cv == float(row[2]) and w.pattern == row[3]
            assert (w.shape, w.scale) == (float(row[4]), float(row[5]))
        data = json.loads((FIXTURE / f"{name}-dataset.json").read_text())
        assert sorted(client.lengths) == sorted(float(k) for k in data)
    # a window takes the latest entry at or before its start
    c = clients["chunk-18"]
    assert c.lengths_at(36000.0) is c.lengths[21600.0]
    assert c.lengths_at(21599.0) is c.lengths[0.0]


def test_a_length_pdf_is_normalised_and_sampled_by_its_probabilities():
    pdf = sg.LengthPdf.parse("{10: 0.2, 30: 0.6, 20: 0.2, 40: 0.0}")
    assert pdf.values == (10, 20, 30)
    assert pdf.cdf == pytest.approx((0.2, 0.4, 1.0))
    assert pdf.mean() == pytest.approx(0.2 * 10 + 0.2 * 20 + 0.6 * 30)
    assert pdf.mean(cap=15) == pytest.approx(0.2 * 10 + 0.8 * 15)
    import random

    rng = random.Random(1)
    draws = [pdf.sample(rng) for _ in range(20000)]
    assert draws.count(30) / len(draws) == pytest.approx(0.6, abs=0.02)
    assert sg.LengthPdf.parse("{}") is None


def _replay(clients, rate_scale=1.0, seed=0, time_scale=1.0, span=range(0, 12)):
    return sg.Replay(tuple(sorted(clients)), span, time_scale, rate_scale, sg.LengthCaps(), seed)


def test_the_replay_is_deterministic_for_a_seed():
    clients = sg.load_clients(FIXTURE)
    a = sg.build_replay(clients, _replay(clients, 0.01, seed=3, time_scale=20))
    b = sg.build_replay(clients, _replay(clients, 0.01, seed=3, time_scale=20))
    c = sg.build_replay(clients, _replay(clients, 0.01, seed=4, time_scale=20))
    assert a == b and len(a) > 50
    assert a != c
    assert [s.index for s in a] == list(range(len(a)))
    assert [s.arrival_s for s in a] == sorted(s.arrival_s for s in a)
    assert all(0 <= s.arrival_s < 12 * 600 / 20 for s in a)


@pytest.mark.parametrize("name", ["chunk-18", "chunk-27"])
def test_each_window_gets_its_rate_and_its_burstiness(name):
    """Per window, the sampled count is within 4 standard deviations of rate x scale x length
    (a renewal process's count has variance ~ n x CV^2), and the gaps' CV is the window's."""
    clients = sg.load_clients(FIXTURE)
    client = clients[name]
    scale = 2000 / (client.windows[0].rate * 600)  # ~2000 requests a window
    specs = sg.sample_client(client, _replay({name: client}, scale))
    for k, w in enumerate(client.windows):
        arrivals = [s.arrival_s for s in specs if k * 600 <= s.arrival_s < (k + 1) * 600]
        expected = w.rate * scale * 600
        assert abs(len(arrivals) - expected) <= 4 * max(1.0, w.cv) * math.sqrt(expected)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        cv = statistics.pstdev(gaps) / statistics.mean(gaps)
        assert cv == pytest.approx(w.cv, rel=0.15), (k, w.pattern)


def test_lengths_follow_the_window_pdf_and_are_capped():
    clients = sg.load_clients(FIXTURE)
    client = clients["chunk-18"]
    caps = sg.LengthCaps(input=64, output=32)
    replay = sg.Replay(("chunk-18",), range(0, 12), 1.0, 0.2, caps, 0)
    specs = sg.sample_client(client, replay)
    inp, out = client.lengths_at(36000.0)
    assert len(specs) > 1000
    assert max(s.prompt_len for s in specs) <= 64 and max(s.max_tokens for s in specs) <= 32
    mean_in = statistics.mean(s.prompt_len for s in specs)
    assert mean_in == pytest.approx(inp.mean(cap=64), rel=0.05)
    assert statistics.mean(s.max_tokens for s in specs) == pytest.approx(
        max(1.0, out.mean(cap=32)), rel=0.05
    )


def test_the_offered_cost_scales_with_the_rate_scale():
    clients = sg.load_clients(FIXTURE)
    one = sg.offered_cost_per_s(clients, _replay(clients, 1.0))
    assert sg.offered_cost_per_s(clients, _replay(clients, 0.5)) == pytest.approx(one / 2)
    by_hand = sum(c.cost_in(range(0, 12), sg.LengthCaps()) for c in clients.values()) / 7200
    assert one == pytest.approx(by_hand)


def _write_client(root: Path, name: str, rows: list[str], dataset: dict) -> None:
    (root / f"{name}-trace.csv").write_text("\n".join(rows) + "\n")
    (root / f"{name}-dataset.json").write_text(json.dumps(dataset))


LENGTHS = {"0": {"input_tokens": "{100: 1.0}", "output_tokens": "{10: 1.0}"}}


def test_picks_the_heaviest_by_cost_and_draws_the_tail_from_the_rest(tmp_path):
    for n, rate in [(1, 5.0), (2, 1.0), (3, 2.0), (4, 0.5), (5, 0.001), (6, 0.0)]:
        pattern = "Gamma,1.0,1.0" if rate else ",0,0"
        _write_client(tmp_path, f"chunk-{n}", [f"0,{rate},1.0,{pattern}"], LENGTHS)
    clients = sg.load_clients(tmp_path)
    heavy, tail = sg.pick_clients(clients, range(0, 1), sg.LengthCaps(), heavy=2, tail=2)
    assert heavy == ["chunk-1", "chunk-3"]
    # chunk-5 sends under 0.5% of the requests, chunk-6 none: neither is drawn
    assert sorted(tail) == ["chunk-2", "chunk-4"]
    with pytest.raises(ValueError, match="asked for 2 heavy \\+ 3 tail"):
        sg.pick_clients(clients, range(0, 1), sg.LengthCaps(), heavy=2, tail=3)


def test_the_busiest_span_has_the_most_offered_cost(tmp_path):
    rates = [1.0, 0.0, 4.0, 4.0, 1.0]
    rows = [f"{600 * k},{r},1.0,{'Gamma,1.0,1.0' if r else ',0,0'}" for k, r in enumerate(rates)]
    _write_client(tmp_path, "chunk-1", rows, LENGTHS)
    clients = sg.load_clients(tmp_path)
    assert sg.busiest_span(clients, 2, sg.LengthCaps()) == range(2, 4)
    assert sg.busiest_span(clients, 1, sg.LengthCaps()) == range(2, 3)  # the first maximum


def test_malformed_files_are_refused_with_their_place(tmp_path):
    _write_client(tmp_path, "chunk-1", ["0,1.0,1.0,Gamma,1,1", "600,1.0,1.0,Zipf,1,1"], LENGTHS)
    with pytest.raises(ValueError, match=r"chunk-1-trace.csv:2: bad pattern 'Zipf'"):
        sg.load_clients(tmp_path)
    (tmp_path / "chunk-1-dataset.json").unlink()
    with pytest.raises(ValueError, match="no chunk-1-dataset.json"):
        sg.load_clients(tmp_path)
    with pytest.raises(FileNotFoundError):
        sg.load_clients(tmp_path / "nowhere")
