"""`fairbatch bench serve --compare serving-path --rounds N`: the medians over rounds, and the
ratio to offline taken within each round (no Ray, no model: rows as the paths report them)."""

from __future__ import annotations

from fairbatch.benchmarks.serving_path import summarize, table


def row(path: str, tok_s: float, offline: float, cpu: dict, ttft: float | None) -> dict:
    return {
        "path": path,
        "requests": 128,
        "ok": 128,
        "output_tok_s": tok_s,
        "cpu_ms_per_token": cpu,
        "replica_share": 0.6 if path != "offline" else 0.0,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft,
        "x_offline": round(tok_s / offline, 3),
    }


def rounds() -> list[list[dict]]:
    out = []
    # offline, serve tok/s and the ingress's CPU per round: the machine differs from round to round
    for off, srv, ingress in (
        (4000.0, 2000.0, 0.15),
        (5000.0, 2000.0, 0.12),
        (3000.0, 1800.0, 0.2),
    ):
        out.append(
            [
                row("offline", off, off, {"client": 0.4}, None),
                row("serve_http@50ms", srv, off, {"replicas": 0.6, "ingress": ingress}, 90.0),
            ]
        )
    return out


def test_medians_per_path_and_role_with_the_within_round_ratio_range():
    offline, serve = summarize(rounds())
    assert offline["path"] == "offline" and offline["rounds"] == 3
    assert offline["output_tok_s"] == 4000.0 and offline["x_offline_range"] == [1.0, 1.0]
    assert serve["output_tok_s"] == 2000.0
    assert serve["cpu_ms_per_token"] == {"ingress": 0.15, "replicas": 0.6}
    # the per-round ratios are 0.5, 0.4 and 0.6: their median, not 2000 / 4000 by chance
    assert serve["x_offline"] == 0.5 and serve["x_offline_range"] == [0.4, 0.6]
    assert serve["ttft_p50_ms"] == 90.0 and offline["ttft_p50_ms"] is None
    assert serve["requests"] == 128 and serve["replica_share"] == 0.6


def test_the_table_shows_the_median_ratio_and_its_range():
    rows = summarize(rounds())
    rows[1]["output_tok_s"] = 1900.0  # the ratio column must come from the rounds, not tok/s
    line = table(rows).splitlines()[-1]
    assert line.startswith("| serve_http@50ms | 1,900 | 0.50 (0.40-0.60) |")
    single = table(rounds()[1]).splitlines()[-1]  # one round: the ratio of its own rows
    assert single.startswith("| serve_http@50ms | 2,000 | 0.40 |")
