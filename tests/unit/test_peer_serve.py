"""`fairbatch bench serve --peer vllm` without vLLM: the server handle (health wait, a server
that dies, stopping its whole session), the table, and the argument errors."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fairbatch.benchmarks.peer import serve
from fairbatch.benchmarks.peer.process import PeerError

# Serves GET /health once it has started a child that sleeps (a stand-in for vLLM's engine
# core process), writes the child's pid where the test can read it, and notes a clean
# shutdown (SIGINT, Python's KeyboardInterrupt) next to it.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    try:
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    except KeyboardInterrupt:
        open(sys.argv[2] + ".sigint", "w").close()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes: it no longer runs.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_server_waits_for_health_and_stops_its_children(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port, pid_file = serve.free_port(), tmp_path / "child.pid"
    cmd = [sys.executable, str(script), str(port), str(pid_file)]
    server = serve.Server("fake", cmd, dict(os.environ), port, tmp_path / "log")
    # started as a shell starts a background job (SIGINT ignored, and inherited so), the
    # server still gets the SIGINT of a clean stop, not only the SIGKILL after the wait
    monkeypatch.setattr(serve, "STOP_TIMEOUT_S", 30.0)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with server as url:
            assert url == f"http://127.0.0.1:{port}"
            child = int(pid_file.read_text())
            assert _alive(child)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert server.proc is None
    assert Path(f"{pid_file}.sigint").exists(), "the server was killed, not stopped"
    deadline = time.monotonic() + 10.0  # a signal is delivered asynchronously
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)  # SIGKILL to the session reached the child too


def test_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    code = "import sys; print('no module named vllm', file=sys.stderr); sys.exit(4)"
    cmd = [sys.executable, "-c", code]
    server = serve.Server("vllm serve", cmd, dict(os.environ), serve.free_port(), tmp_path / "l")
    with pytest.raises(PeerError, match="vllm serve exited with code 4(.|\n)*no module named vllm"):
        with server:
            pass


def test_table_and_ratio() -> None:
    row = {"requests_per_s": 1.0, "ttft_ms": {"p50": 12.0, "p99": 30.5}}
    summary = {
        "fairbatch": {**row, "output_tok_s": 90.0, "tpot_ms": {"p50": 8.0, "p99": 9.0}},
        "vllm": {**row, "output_tok_s": 120.0, "tpot_ms": {"p50": None, "p99": None}},
        "ratio_fairbatch_to_vllm": 0.75,
    }
    table = serve.format_table(summary).splitlines()
    assert table[1].split() == ["fairbatch", "90.0", "1.00", "12.0", "30.5", "8.0", "9.0"]
    assert table[2].split() == ["vllm", "120.0", "1.00", "12.0", "30.5", "-", "-"]
    assert table[3].endswith("0.750")


def test_cli_peer_errors(capsys: pytest.CaptureFixture) -> None:
    from fairbatch.deployments.cli import main

    assert main(["bench", "serve", "--peer", "vllm"]) == 1
    assert "--peer-python is required" in capsys.readouterr().err
    args = ["bench", "serve", "--peer", "vllm", "--peer-python", sys.executable]
    assert main([*args, "--checkpoint", "/nonexistent"]) == 1
    assert "neither a known shape" in capsys.readouterr().err


def test_rounds_alternate_the_servers_and_report_medians(monkeypatch, tmp_path: Path) -> None:
    """--rounds 3: the servers' order alternates round by round; each server's row is the
    median of its rounds, and the ratio the median of the rounds' ratios."""
    import argparse

    started: list[str] = []
    rates = {"vllm": iter([100.0, 120.0, 110.0]), "fairbatch": iter([90.0, 130.0, 100.0])}

    class FakeServer:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> str:
            started.append(self.name)
            return self.name

        def __exit__(self, *exc: object) -> None:
            pass

    def fake_measure(url: str, wl, args) -> dict:
        rate = next(rates[url])
        return {
            "output_tok_s": rate, "requests_per_s": rate / 100, "completed": 4, "failed": 0,
            "ttft_ms": {"p50": 1000 / rate, "p99": None}, "tpot_ms": {"p50": 5.0, "p99": 6.0},
            "duration_s": 2.0,
        }  # fmt: skip

    monkeypatch.setattr(serve, "vllm_server", lambda *a: FakeServer("vllm"))
    monkeypatch.setattr(serve, "fairbatch_server", lambda *a: FakeServer("fairbatch"))
    monkeypatch.setattr(serve, "measure", fake_measure)
    monkeypatch.setattr(serve, "check_peer_python", lambda path: path)
    args = argparse.Namespace(
        peer_python=sys.executable, checkpoint="tiny", num_gpu_blocks=64, max_num_seqs=4,
        rounds=3, out=str(tmp_path), num_prompts=4, rate=float("inf"), process="poisson",
        burstiness=1.0, concurrency=None, input_len="fixed:8", output_len="fixed:4",
        sharegpt=None, shared_prefix=None, tenants=None, seed=0, timeout=60.0,
        no_progress=True,
    )  # fmt: skip
    assert serve.run(args) == 0
    assert started == ["vllm", "fairbatch", "fairbatch", "vllm", "vllm", "fairbatch"]
    summary = json.loads((tmp_path / "result.json").read_text())
    assert summary["vllm"]["output_tok_s"] == 110.0
    assert summary["fairbatch"]["output_tok_s"] == 100.0
    assert summary["fairbatch"]["completed"] == 12
    assert summary["fairbatch"]["ttft_ms"] == {"p50": 10.0, "p99": None}
    # the rounds' ratios are 0.9, 1.083 and 0.909
    assert summary["ratio_fairbatch_to_vllm"] == 0.909
    assert summary["ratio_range"] == [0.9, 1.083]
    assert len(summary["rounds"]) == 3


def test_both_servers_compute_in_the_asked_dtype(tmp_path: Path) -> None:
    """--dtype bfloat16: vLLM is told so and its KV bytes are bf16's (half of float32's for the
    same tokens); fairbatch's app config carries the same dtype."""
    import yaml

    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
                    "num_hidden_layers": 3})
    )  # fmt: skip
    eng = {"max_num_seqs": 4, "max_num_batched_tokens": 2048, "max_model_len": 256,
           "kv_tokens": 1024}  # fmt: skip
    kv_bytes = {}
    for dtype in ("float32", "bfloat16"):
        cmd = serve.vllm_server("py", tmp_path, {**eng, "dtype": dtype}, 1, tmp_path / "v.log").cmd
        assert cmd[cmd.index("--dtype") + 1] == dtype
        kv_bytes[dtype] = int(cmd[cmd.index("--kv-cache-memory-bytes") + 1])
        serve.fairbatch_server(tmp_path, {**eng, "dtype": dtype}, 1, tmp_path)
        app = yaml.safe_load((tmp_path / "fairbatch.yaml").read_text())
        assert app["engine"]["dtype"] == dtype
    # (1024 + one null block of 128) tokens x 2 (K, V) x 3 layers x 2 heads x 16 dims x bytes
    assert kv_bytes == {"float32": 1152 * 2 * 3 * 2 * 16 * 4, "bfloat16": 1152 * 2 * 3 * 2 * 16 * 2}


def test_the_warmup_sends_prompts_of_its_own() -> None:
    """The warm-up's requests have the workload's lengths but none of its prompts (nor the
    same start): a measured prompt sent in the warm-up would be a prefix-cache hit in
    fairbatch's 16-token blocks and not in vLLM's 128."""
    import argparse

    from fairbatch.benchmarks.serve_bench import custom_workload

    args = argparse.Namespace(
        num_prompts=32, rate=float("inf"), process="poisson", burstiness=1.0, concurrency=32,
        input_len="fixed:64", output_len="fixed:64", sharegpt=None, shared_prefix=None,
        tenants=None, seed=0,
    )  # fmt: skip
    measured = custom_workload(args).specs
    warm = serve.warmup_specs(args)
    assert len(warm) == serve.WARMUP_REQUESTS
    assert {(s.prompt_len, s.max_tokens, s.arrival_s) for s in warm} == {(64, 64, 0.0)}
    starts = {s.prompt[:24] for s in measured}
    assert len(starts) == len(measured)  # the check below can tell the prompts apart
    assert not any(s.prompt[:24] in starts for s in warm)
