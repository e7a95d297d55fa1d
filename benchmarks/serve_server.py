"""A local fairbatch server for `fairbatch bench serve`: one engine, no Ray.

    python -m fairbatch.benchmarks.serve_server --config CFG.yaml --port P [--host 127.0.0.1]

CFG.yaml holds the app config (`deployments/api/config.py`: tenants, admin key, limits); its
`engine` mapping is passed to `build_engine` as keyword arguments (policy, preemption_mode,
num_gpu_blocks, max_num_seqs, ...). The server runs until SIGTERM or SIGINT, then shuts the
engine down. `--port 0` binds a free port; `--port-file` receives the bound port once the
socket is listening, so a parent never races another process for a port.

`LocalServer(config)` runs that server as a subprocess for one benchmark run: it writes the
config to a temp dir, starts the process, waits (bounded) for /health and gives the base URL;
on exit it sends SIGTERM, then SIGKILL, and removes the temp dir. The child also watches its
parent and stops if the parent dies, so nothing is left behind even after a SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 180.0  # torch import + model build on a busy 2-core machine
STOP_TIMEOUT_S = 10.0
LOOPBACK = "127.0.0.1"


# ---- the server process ----------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Stop this process (SIGTERM to itself: a clean shutdown) once `parent_pid` is gone."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


async def serve(config_path: str, host: str, port: int, port_file: str | None) -> None:
    import uvicorn

    from fairbatch.deployments.api.backend import LocalBackend, create_app
    from fairbatch.deployments.api.config import ConfigError, load_config

    config = load_config(config_path)
    try:  # the engine settings are build_engine's keyword arguments (policy_kwargs included)
        backend = LocalBackend.build(config.model, **config.engine)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"engine: {e}") from None
    app = create_app(backend, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(str(sock.getsockname()[1]))
        tmp.replace(port_file)  # atomic: the reader never sees a partial number
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=5,
            timeout_graceful_shutdown=3,  # open streams are cut after this; the engine stops
        )
    )
    try:
        await server.serve(sockets=[sock])
    finally:
        await backend.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fairbatch.benchmarks.serve_server")
    p.add_argument("--config", required=True, help="app config YAML (engine = build_engine kwargs)")
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument("--parent-pid", type=int, help="stop when this process is gone")
    args = p.parse_args(argv)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    from fairbatch.deployments.api.config import ConfigError

    try:
        asyncio.run(serve(args.config, args.host, args.port, args.port_file))
    except ConfigError as e:
        print(f"serve_server: {e}", file=sys.stderr)
        return 2
    return 0


# ---- the parent's handle ---------------------------------------------------------------------


class LocalServer:
    """`with LocalServer(config) as url:` a fresh server subprocess on 127.0.0.1.

    `config` is the app config as a dict (see `deployments/api/config.py`). Start-up waits at most
    `start_timeout_s` for /health; a server that exits or never gets healthy raises
    RuntimeError with the tail of its log. Exit always stops the process (SIGTERM, then SIGKILL
    after `STOP_TIMEOUT_S`) and removes the temp dir.
    """

    def __init__(self, config: dict[str, Any], *, start_timeout_s: float = START_TIMEOUT_S):
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None
        self.url: str | None = None

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        import yaml

        self.dir = Path(tempfile.mkdtemp(prefix="fairbatch-bench-"))
        cfg, port_file, log = self.dir / "config.yaml", self.dir / "port", self.dir / "server.log"
        cfg.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [
            sys.executable, "-m", "fairbatch.benchmarks.serve_server", "--config", str(cfg),
            "--host", LOOPBACK, "--port", "0", "--port-file", str(port_file),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the local server exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            if self.url is None and port_file.exists():
                self.url = f"http://{LOOPBACK}:{int(port_file.read_text())}"
            if self.url is not None and _healthy(self.url):
                return self.url
            time.sleep(0.2)
        raise RuntimeError(
            f"the local server was not healthy after {self.start_timeout_s:.0f}s:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, n: int = 20) -> str:
        if self.dir is None or not (self.dir / "server.log").exists():
            return ""
        lines = (self.dir / "server.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """Stop the process and remove the temp dir. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
