"""Serve apps over real HTTP on loopback from a background event loop (tests, examples).

`ServerLoop` owns one event loop in a daemon thread; `serve(app)` starts a uvicorn server for
`app` on 127.0.0.1 with a free port on that loop and returns its base URL. Several apps can
share one loop, and so one `LocalBackend` (its AsyncEngine is bound to the loop it first runs
on). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

import uvicorn

START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout_s: float, what: str, every: float = 0.25):
    """Poll `pred()` until it returns something truthy (returned) or `timeout_s` passes
    (AssertionError naming `what` and the last result or exception)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # not up yet
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {last!r}")


class ServerLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="api-loop", daemon=True)
        self._thread.start()
        self._servers: list[tuple[uvicorn.Server, asyncio.Future]] = []

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        """Run `coro` on the loop and wait (at most `timeout` s) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: Any) -> str:
        """Start serving `app`; returns "http://127.0.0.1:PORT"."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=5)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        fut = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)

        async def started() -> None:
            while not server.started:
                if fut.done():
                    fut.result()  # raises the start-up error
                    raise RuntimeError("server exited during start-up")
                await asyncio.sleep(0.01)

        self.run(asyncio.wait_for(started(), START_TIMEOUT_S), START_TIMEOUT_S + 5)
        self._servers.append((server, fut))
        return f"http://127.0.0.1:{port}"

    def close(self, timeout: float = 30.0) -> None:
        """Stop every server, then the loop."""
        for server, _ in self._servers:
            server.should_exit = True
        for _, fut in self._servers:
            try:
                fut.result(timeout)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


# ---- Serve apps on a local Ray (tests) ---------------------------------------------------------


def wait_app_running(timeout_s: float, name: str = "fairbatch", failure: list | None = None):
    """Wait until Serve reports application `name` RUNNING; AssertionError (with Serve's
    message) if it failed to deploy, or if `failure` (filled by a deploying thread) is set."""
    from ray import serve

    def running() -> bool:
        if failure:
            raise AssertionError(f"deploy failed: {failure[0]!r}")
        app = serve.status().applications.get(name)
        if app is not None and app.status == "DEPLOY_FAILED":
            raise AssertionError(f"deploy failed: {app.message}")
        return app is not None and app.status == "RUNNING"

    deadline = time.monotonic() + timeout_s
    while not running():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for app {name!r}")
        time.sleep(1.0)


def wait_healthy(base: str, timeout_s: float = 60.0) -> None:
    import httpx

    wait_for(
        lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, timeout_s, "/health"
    )


def run_serve_app(args: dict, http_port: int, timeout_s: float) -> str:
    """`serve.run(build_app(args))` as app "fairbatch" at / on a Ray that is already up, with
    Serve's HTTP proxy on 127.0.0.1:`http_port`; bounded (serve.run itself has no timeout, so it
    runs in a thread). Returns the base URL once /health answers 200."""
    from ray import serve

    from fairbatch.deployments.serve.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    failure: list[BaseException] = []

    def deploy() -> None:
        try:
            serve.run(build_app(args), name="fairbatch", route_prefix="/")
        except BaseException as e:  # noqa: BLE001 - reported by wait_app_running
            failure.append(e)

    threading.Thread(target=deploy, daemon=True).start()
    wait_app_running(timeout_s, failure=failure)
    from fairbatch.deployments.serve.app import ingress_url

    base = ingress_url("fairbatch", f"http://127.0.0.1:{http_port}")
    wait_healthy(base)
    return base
