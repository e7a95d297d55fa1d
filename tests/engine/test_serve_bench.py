"""`fairbatch bench serve` end to end against the served app (a LocalServer subprocess on
127.0.0.1 running the tiny model), and the CLI's argument errors.

Facts checked, none of them a wall-clock time: every request ends (completed or rejected, none
lost); each completion has exactly its max_tokens (ignore_eos) and the prompt tokens the
server's tokenizer gives; a streamed chunk carries at least one token, so chunks <= completion
tokens (the server holds text back at an incomplete UTF-8 character, so fewer chunks than
tokens is normal); the server's prefix-cache hits over a sequential shared-prefix run equal
exactly what whole-block caching must give; result.json has its documented keys (a summary:
no per-request rows, which go to --raw-out) and the PNGs are PNGs.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest
from loopback import free_port

from fairbatch.benchmarks.serve_bench import ADMIN_KEY, local_config, tenant_key
from fairbatch.benchmarks.serve_client import get_stats, run_requests
from fairbatch.benchmarks.serve_server import LocalServer
from fairbatch.benchmarks.serve_workload import TenantPlan, build_workload, parse_lengths
from fairbatch.deployments import cli
from fairbatch.engine.tokenizer import Tokenizer

MODEL = "fairbatch-tiny"
BLOCK = 16  # build_engine's default block size
TENANTS = [TenantPlan("a", weight=1.0), TenantPlan("b", weight=2.0)]
CAPPED = TenantPlan("capped", tokens_per_minute=60.0)  # a bucket of 60 tokens, 1 token/s
KEYS = {t.name: tenant_key(t.name) for t in [*TENANTS, CAPPED]}
ENGINE = {"policy": "weighted_fair", "max_num_seqs": 8, "num_gpu_blocks": 512}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_KEYS = {"kind", "meta", "workload", "summary", "window", "plots"}
SUMMARY_KEYS = {
    "duration_s", "requests", "throughput", "tenants", "jain_index", "max_service_difference",
    "vtc_bound", "server",
}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with LocalServer(local_config([*TENANTS, CAPPED], ENGINE)) as url:
        yield url


def check_results(results, tokenizer: Tokenizer) -> None:
    """Every request completed with its exact token counts; chunks within the tokens."""
    for r in results:
        assert r.ok, (r.spec.index, r.status, r.error)
        assert r.finish_reason == "length"
        assert r.completion_tokens == r.spec.max_tokens
        assert r.prompt_tokens == len(tokenizer.encode(r.spec.prompt))
        assert 1 <= len(r.chunk_times_s) <= r.completion_tokens
        assert r.send_s <= r.first_token_s <= r.chunk_times_s[-1] <= r.end_s
        assert r.chunk_times_s == sorted(r.chunk_times_s)


def expected_prefix_hits(results, tokenizer: Tokenizer) -> int:
    """What the prefix cache must give a sequential run: each prompt reuses the whole blocks it
    shares with an earlier prompt of its tenant (the cache is salted per tenant), keeping at
    least its last token to compute. Earlier requests' outputs never match: every prompt
    differs from every other within its own length."""
    seen: dict[str, list[list[int]]] = {}
    total = 0
    for r in sorted(results, key=lambda r: r.send_s):
        ids = tokenizer.encode(r.spec.prompt)
        best = 0
        for other in seen.get(r.spec.tenant, []):
            n = 0
            while n < min(len(ids), len(other)) and ids[n] == other[n]:
                n += 1
            best = max(best, n)
        total += min(best // BLOCK, (len(ids) - 1) // BLOCK) * BLOCK
        seen.setdefault(r.spec.tenant, []).append(ids)
    return total


def test_shared_prefix_hits_are_exact(server):
    tokenizer = Tokenizer.tiny()
    specs = build_workload(
        10,
        rate=1.0,
        process="all-at-once",
        input_lens=parse_lengths("uniform:5-30"),
        output_lens=parse_lengths("uniform:2-6"),
        tenants=TENANTS,
        shared_prefix=(2, 40),
        seed=101,
    )

    async def run():
        before = await get_stats(server, ADMIN_KEY)
        # One at a time: each request finds every earlier one's blocks cached.
        results, _ = await run_requests(
            server, specs, model=MODEL, keys=KEYS, max_concurrency=1, timeout_s=60, progress=False
        )
        return before, results, await get_stats(server, ADMIN_KEY)

    before, results, after = asyncio.run(run())
    assert [r.spec for r in results] == specs
    check_results(results, tokenizer)
    hits = after["engine"]["prefix_hit_tokens"] - before["engine"]["prefix_hit_tokens"]
    expected = expected_prefix_hits(results, tokenizer)
    assert expected >= 2 * BLOCK  # the workload does exercise the cache
    assert hits == expected, (hits, expected)
    assert after["rejected"] == before["rejected"]


def test_quota_rejections_are_recorded(server):
    """A tenant over its quota gets 429s: recorded as rejections with their Retry-After, and
    every request is accounted for (completed + rejected = sent)."""
    specs = build_workload(
        8,
        rate=1.0,
        process="all-at-once",
        input_lens=parse_lengths("fixed:25"),
        output_lens=parse_lengths("fixed:3"),
        tenants=[CAPPED],
        seed=5,
    )
    results, _ = asyncio.run(
        run_requests(server, specs, model=MODEL, keys=KEYS, timeout_s=60, progress=False)
    )
    assert len(results) == len(specs)
    ok = [r for r in results if r.ok]
    rejected = [r for r in results if not r.ok]
    assert ok and rejected  # the bucket (60 tokens) admits a couple of 26-token prompts
    check_results(ok, Tokenizer.tiny())
    for r in rejected:
        assert r.status == 429 and "quota" in r.error, (r.status, r.error)
        assert r.retry_after_s is not None and r.retry_after_s > 0
        assert r.first_token_s is None and not r.chunk_times_s


def read_png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def read_rows(path: Path) -> list[dict]:
    """The --raw-out file: one JSON object per line."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_run_against_the_served_app(server, tmp_path, capsys):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    out = tmp_path / "out"
    argv = [
        "bench", "serve", "--url", server, "--keys", str(keys_file), "--admin-key", ADMIN_KEY,
        "--num-prompts", "24", "--rate", "30", "--tenants", "a:1,b:2", "--seed", "7",
        "--input-len", "uniform:8-40", "--output-len", "uniform:3-10", "--shared-prefix", "2,32",
        "--slo-ttft", "60000", "--out", str(out), "--no-progress",
        "--raw-out", str(tmp_path / "requests.jsonl"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| tenant |" in printed and "prefix-cache hits" in printed

    result = json.loads((out / "result.json").read_text())
    assert set(result) == RUN_KEYS and result["kind"] == "run"
    assert result["meta"]["command"].startswith("fairbatch bench serve --url")
    assert result["meta"]["model"] == MODEL
    summary = result["summary"]
    assert SUMMARY_KEYS <= set(summary) and "goodput" in summary
    assert set(summary["requests"]) == {"ttft", "tpot", "itl", "e2e"}
    rows = read_rows(tmp_path / "requests.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(24))  # none lost
    for row in rows:
        assert row["ok"], row
        assert row["completion_tokens"] == row["max_tokens"]
        assert 1 <= row["chunks"] <= row["completion_tokens"]
    tp = summary["throughput"]
    assert (tp["completed"], tp["rejected"], tp["failed"]) == (24, 0, 0)
    assert {n: t["weight"] for n, t in summary["tenants"].items()} == {"a": 1.0, "b": 2.0}
    assert sum(t["sent"] for t in summary["tenants"].values()) == 24
    assert summary["server"]["engine"]["prefix_hit_tokens"] > 0
    assert summary["goodput"]["requests_per_s"] > 0
    assert sorted(result["plots"]) == ["latency_cdf.png", "service_over_time.png", "throughput.png"]
    for name in result["plots"]:
        w, h = read_png_size(out / name)
        assert w > 100 and h > 100


def test_cli_scenario_on_its_own_local_server(tmp_path, capsys):
    """The default target: a LocalServer started for the run, a named scenario (capacity given,
    so no calibration), plots off."""
    out = tmp_path / "out"
    argv = [
        "bench", "serve", "--scenario", "vtc_overload", "--capacity", "2", "--duration", "2",
        "--scale", "0.2", "--max-num-seqs", "8", "--out", str(out), "--no-plots", "--no-progress",
        "--raw-out", str(tmp_path / "requests.jsonl"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["plots"] == [] and result["meta"]["target"] == "local"
    assert result["workload"]["scenario"] == "vtc_overload"
    assert result["meta"]["server"]["engine"]["max_num_seqs"] == 8
    assert "api_key" not in json.dumps(result["meta"]["server"])  # keys stay out of results
    rows = read_rows(tmp_path / "requests.jsonl")
    assert len(rows) == result["workload"]["num_requests"] > 0
    assert {r["tenant"] for r in rows} == {"A", "B"}
    # vtc_overload has no quotas, the local server's limits are 100_000 in flight (far above
    # its few requests) and no --max-drain cuts a request off: every one completes in full.
    for row in rows:
        assert row["ok"] and row["status"] == 200 and row["finish_reason"] == "length", row
        assert row["completion_tokens"] == row["max_tokens"], row
    assert not list(out.glob("*.png"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input-len", "bogus:3"], "bad length spec"),
        (["--output-len", "uniform:9-2"], "LO <= HI"),
        (["--shared-prefix", "2"], "GROUPS,PREFIX_LEN"),
        (["--tenants", "a:x"], "bad number"),
        (["--tenants", "a,a"], "duplicate"),
        (["--rate", "-1"], "must be > 0"),
        (["--policy", "lottery"], "invalid choice"),
        (["--scenario", "nope"], "unknown scenario"),
        (["--scenario", "vtc_overload", "--rate", "2"], "exclude each other"),
        (["--burstiness", "0.5"], "--process gamma"),
        (["--concurrency", "4", "--rate", "2"], "--concurrency"),
        (["--capacity", "3"], "--capacity applies"),
        (["--compare", "policies", "--url", "http://127.0.0.1:9"], "drop --url"),
        (["--compare", "policies", "--rate", "3"], "runs a scenario"),
        (["--compare", "preemption", "--scenario", "weighted"], "drop --scenario"),
        (["--keys", "k.json"], "--keys applies to --url"),
    ],
)
def test_cli_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_unreachable_url_fails_in_one_line(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert cli.main(["bench", "serve", "--url", url, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fairbatch bench serve: cannot reach {url}") and "\n" not in err
