"""`fairbatch serve` as a user runs it: a subprocess, /health, one completion, then Ctrl-C
(SIGINT) or SIGTERM (`kill`, systemd, `docker stop`): a clean stop, exit 0."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from loopback import free_port

openai = pytest.importorskip("openai")

START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 90


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_fairbatch_serve_starts_answers_and_stops_cleanly(stop):
    tmp = tempfile.mkdtemp(prefix="fbcli-", dir="/tmp")  # short: Ray's socket paths are capped
    try:
        run_cli(Path(tmp), stop)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_cli(tmp_path: Path, stop: int) -> None:
    port = free_port()
    env = dict(os.environ)  # conftest: RAY_AUTH_MODE=disabled, usage stats off, private tmp
    env.setdefault("RAY_agent_register_timeout_ms", "120000")
    env["RAY_TMPDIR"] = str(tmp_path)
    log = (tmp_path / "serve.log").open("w+")
    cmd = [sys.executable, "-m", "fairbatch.deployments.cli", "serve", "--port", str(port)]
    # Its own process group: if the test fails, everything it started goes with it.
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"fairbatch serve exited early:\n{_read(log)}"
            assert time.monotonic() < deadline, f"/health not ready:\n{_read(log)}"
            try:  # ready: the banner is out and the API answers
                if "Ctrl-C stops it" in _read(log):
                    if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        out = c.completions.create(model="fairbatch-tiny", prompt="Hello", max_tokens=5)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason
        banner = _read(log)
        assert f"{base}/v1" in banner and "curl" in banner and "dashboard:" in banner
        assert "RANDOM weights" in banner  # the tiny model's text is noise, and it says so
        assert "no token needed" in banner  # RAY_AUTH_MODE=disabled here (conftest)
        # The app's processes run at the niceness of `fairbatch serve`, not Ray's default 15
        # for workers (below any client on the machine).
        nice = {name: n for name, n in _session_niceness(proc.pid).items() if name in APP_ROLES}
        assert set(nice) == set(APP_ROLES) and set(nice.values()) == {os.getpriority(
            os.PRIO_PROCESS, proc.pid)}, nice  # fmt: skip
        proc.send_signal(stop)
        assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, _read(log)
        assert "stopping fairbatch..." in _read(log) and "stopped." in _read(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


APP_ROLES = ("ray::ClusterReplica", "ray::ClusterController", "ray::ServeReplica")


def _session_niceness(sid: int) -> dict[str, int]:
    """Role (process title up to the first ':' after 'ray::') -> niceness, over the processes
    of session `sid` (the test starts `fairbatch serve` in a session of its own)."""
    psutil = pytest.importorskip("psutil")
    out: dict[str, int] = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if os.getsid(p.pid) != sid:
                continue
            title = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
            for role in APP_ROLES:
                if title.startswith(role):
                    out[role] = p.nice()
        except (psutil.Error, ProcessLookupError):
            continue
    return out


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-4000:]
