"""`fairbatch bench engine --peer vllm` without vLLM: a fake peer process speaks the peer
protocol (benchmarks/peer/process.py), a fake fairbatch side returns known rounds, and the
summary, table and errors are checked against them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fairbatch.benchmarks.peer import offline, vllm_offline
from fairbatch.benchmarks.peer.process import PeerError, PeerProcess, check_peer_python

# The fake peer answers "round" k (1-based) with tok_s 100 * k, TTFT 10 ms * k and TPOT 2 ms,
# and outputs: the first max_tokens ids of each prompt, except request 1, whose token 3 is -1.
FAKE_PEER = textwrap.dedent(
    """
    import json, os, sys
    settings = json.load(open(sys.argv[1]))
    out = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    mode = settings.get("fake_mode", "ok")
    if mode == "crash":
        print("ImportError: the fake peer has no vllm", file=sys.stderr)
        sys.exit(3)
    out.write(json.dumps({"ready": True, "version": "fake", "kv_blocks": 8, "block_size": 32})
              + "\\n")
    k = 0
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        k += 1
        if mode == "garbage":
            out.write("not json\\n")
            continue
        outputs = [p[: settings["max_tokens"]] for p in settings["prompts"]]
        outputs[1] = outputs[1][:3] + [-1] + outputs[1][4:]
        n = len(outputs)
        out.write(json.dumps({
            "tok_s": 100.0 * k, "wall_s": 1.0, "tokens": n * settings["max_tokens"],
            "ttft_s": [0.01 * k] * n, "tpot_s": [0.002] * n, "outputs": outputs,
        }) + "\\n")
    """
)


class FakeFairbatch:
    """Rounds at 50 tok/s then 70 tok/s, TTFT 20 ms, TPOT 4 ms, outputs = the prompts' ids."""

    def __init__(self, settings: dict) -> None:
        self.settings, self.k, self.load_s = settings, 0, 0.0

    def round(self) -> dict:
        self.k += 1
        n = len(self.settings["prompts"])
        return {
            "tok_s": [50.0, 70.0][self.k - 1],
            "wall_s": 1.0,
            "tokens": n * self.settings["max_tokens"],
            "ttft_s": [0.02] * n,
            "tpot_s": [0.004] * n,
            "outputs": [p[: self.settings["max_tokens"]] for p in self.settings["prompts"]],
        }


def _settings(mode: str = "ok") -> dict:
    return {
        "model": "/nonexistent",
        "dtype": "float32",
        "prompts": offline.make_prompts(4, 8, vocab=2048),
        "max_tokens": 6,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "max_model_len": 14,
        "kv_tokens": 128,
        "block_size": 32,
        "warmup_tokens": 2,
        "fake_mode": mode,
    }


@pytest.fixture
def fake_peer(tmp_path: Path) -> Path:
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    return script


def test_summary_table_and_ratio_from_fake_peer(fake_peer: Path, monkeypatch) -> None:
    monkeypatch.setattr(offline, "SETTLE_S", 0.0)  # no idle peer to wait for
    summary = offline.run(
        _settings(), sys.executable, 2, peer_script=fake_peer, fairbatch_side=FakeFairbatch,
        progress=False,
    )  # fmt: skip
    assert summary["fairbatch"]["tok_s"] == [50.0, 70.0]
    assert summary["vllm"]["tok_s"] == [100.0, 200.0]
    assert summary["fairbatch"]["median_tok_s"] == 60.0
    assert summary["vllm"]["median_tok_s"] == 150.0
    assert summary["ratio_fairbatch_to_vllm"] == 0.4
    assert summary["vllm"]["ttft_ms"] == {"p50": 10.0, "p99": 20.0}  # rounds 1 and 2
    assert summary["vllm"]["tpot_ms"] == {"p50": 2.0, "p99": 2.0}
    assert summary["fairbatch"]["ttft_ms"] == {"p50": 20.0, "p99": 20.0}
    assert summary["greedy"] == {"identical": 3, "requests": 4, "first_difference_at": [3]}
    assert summary["vllm_version"] == "fake"
    assert summary["vllm_kv_tokens"] == 256
    table = offline.format_table(summary)
    assert "0.400" in table and "3 of 4 requests" in table
    fb_row = next(line for line in table.splitlines() if line.startswith("fairbatch"))
    assert fb_row.split()[1:4] == ["50.0", "70.0", "60.0"]


def test_peer_that_dies_before_ready_is_reported_with_its_log(fake_peer: Path) -> None:
    with pytest.raises(PeerError, match="exited with code 3(.|\n)*the fake peer has no vllm"):
        offline.run(
            _settings("crash"), sys.executable, 1, peer_script=fake_peer,
            fairbatch_side=FakeFairbatch, progress=False,
        )  # fmt: skip


def test_peer_that_answers_garbage_is_reported(fake_peer: Path) -> None:
    with PeerProcess(sys.executable, fake_peer, _settings("garbage")) as peer:
        assert peer.read(60)["ready"] is True
        with pytest.raises(PeerError, match="not JSON"):
            peer.command("round", 60)


def test_peer_python_errors(tmp_path: Path) -> None:
    with pytest.raises(PeerError, match="required"):
        check_peer_python(None)
    with pytest.raises(PeerError, match="no such file"):
        check_peer_python(str(tmp_path / "missing" / "python"))
    plain = tmp_path / "python"
    plain.write_text("")
    with pytest.raises(PeerError, match="not an executable"):
        check_peer_python(str(plain))


def test_cli_missing_peer_python_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    from fairbatch.deployments.cli import main

    code = main(["bench", "engine", "--peer", "vllm", "--peer-python", "/nonexistent/python"])
    assert code == 1
    assert "--peer-python /nonexistent/python: no such file" in capsys.readouterr().out


def test_kv_capacity_matches_in_tokens(tmp_path: Path) -> None:
    """Both engines get the same KV capacity in tokens: a multiple of both block sizes, and
    the peer's KV bytes buy exactly the tokens fairbatch's blocks hold."""
    import torch

    from fairbatch.benchmarks.checkpoints import hf_config
    from fairbatch.engine.config import ModelConfig
    from fairbatch.kv.cache_engine import KVLayout

    assert offline.kv_tokens_for(3, 100, 16, 128) == 384  # 300 rounded up to 128 (and 16)
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen2.5-0.5b")))
    args = SimpleNamespace(
        prompt_len=60, max_tokens=40, max_num_seqs=3, kv_tokens=None, peer_block_size=128,
        dtype="bfloat16", num_requests=5, max_num_batched_tokens=2048, seed=0,
    )  # fmt: skip
    settings = offline.settings_for(args, tmp_path)
    assert settings["kv_tokens"] == 384 and settings["max_model_len"] == 100
    assert [len(p) for p in settings["prompts"]] == [60] * 5
    assert all(4 <= t < 2048 for p in settings["prompts"] for t in p)
    with pytest.raises(ValueError, match="multiple of block size 128"):
        offline.settings_for(SimpleNamespace(**{**vars(args), "kv_tokens": 400}), tmp_path)
    for shape in ("qwen2.5-0.5b", "llama-3.2-1b"):
        config = hf_config(shape)
        ours = ModelConfig.from_hf_dict(config)
        for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            layout = KVLayout(
                ours.num_hidden_layers, ours.num_key_value_heads, ours.head_dim, 16, torch_dtype
            )
            assert vllm_offline.kv_bytes_per_token(config, dtype) == layout.bytes_per_token
            # vLLM's block pool keeps one null block out of use: it is given one more
            assert vllm_offline.peer_kv_bytes(4096, 128, config, dtype) == (
                (4096 + 128) * layout.bytes_per_token
            )


def test_vllm_round_result_reads_request_metrics() -> None:
    def output(tokens: list[int], arrival: float, first: float, last: float, latency: float):
        metrics = SimpleNamespace(
            arrival_time=arrival, first_token_ts=first, last_token_ts=last,
            first_token_latency=latency, num_generation_tokens=len(tokens),
        )  # fmt: skip
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)], metrics=metrics)

    # the round began at 100.0; the requests arrived (were added) at 100.5 and 101.0
    outs = [output([5, 6, 7], 100.5, 10.0, 10.5, 0.25), output([8], 101.0, 11.0, 11.0, 0.5)]
    r = vllm_offline.round_result(outs, wall=2.0, started=100.0)
    assert r["tokens"] == 4 and r["tok_s"] == 2.0
    assert r["ttft_s"] == [0.75, 1.5]  # from the round's start, as fairbatch's side counts
    assert r["tpot_s"] == [0.25]  # (10.5 - 10.0) / 2; one token has no TPOT
    assert r["outputs"] == [[5, 6, 7], [8]]
    no_metrics = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])], metrics=None)]
    assert vllm_offline.round_result(no_metrics, 1.0, 0.0)["ttft_s"] is None


def test_cli_imports_no_benchmark_module_torch_or_ray() -> None:
    """Parsing imports the benchmarks' parser only (stdlib), never a benchmark itself."""
    code = (
        "import sys\n"
        "from fairbatch.deployments.cli import build_parser\n"
        "build_parser().parse_args(['bench', 'engine', '--peer', 'vllm'])\n"
        "parser = ('fairbatch.benchmarks', 'fairbatch.benchmarks.cli')\n"
        "bad = [m for m in sys.modules if m.startswith('fairbatch.benchmarks')\n"
        "       and m not in parser or m in ('torch', 'ray', 'transformers', 'httpx')]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().replace("'", '"')) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_benchmark_takes_its_peer_and_the_peers_children_down(tmp_path: Path) -> None:
    """SIGKILL the process that started a peer (no cleanup runs): the peer and a process the
    peer started, as vLLM starts its engine core, are gone within seconds."""
    pids = tmp_path / "pids"
    peer = tmp_path / "peer.py"
    peer.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
            os.fdopen(int(sys.argv[2]), "w").write('{{"ready": true}}\\n')
            time.sleep(120)
            """
        )
    )
    bench_code = textwrap.dedent(
        f"""
        import sys, time
        from fairbatch.benchmarks.peer.process import PeerProcess
        peer = PeerProcess(sys.executable, {str(peer)!r}, {{}})
        peer.read(60)
        print("ready", flush=True)
        time.sleep(120)
        """
    )
    bench = subprocess.Popen([sys.executable, "-c", bench_code], stdout=subprocess.PIPE)
    try:
        assert bench.stdout is not None and bench.stdout.readline().strip() == b"ready"
        peer_pid, child_pid = map(int, pids.read_text().split())
        assert _alive(peer_pid) and _alive(child_pid)
    finally:
        bench.kill()
        bench.wait()
    deadline = time.monotonic() + 20
    while _alive(peer_pid) or _alive(child_pid):
        assert time.monotonic() < deadline, "the peer outlived the benchmark that started it"
        time.sleep(0.1)
