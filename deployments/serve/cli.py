"""`fairbatch serve`: a local Ray (dashboard on), the fairbatch app on it, until Ctrl-C.

On a machine without CUDA the replicas run the model on CPU and Ray is given N fake GPUs
(one per replica), so the cluster has exactly the shape it has on a GPU machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

EXAMPLE_PROMPT = "Hello!"


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    from fairbatch.deployments.serve.app import read_args_file

    data: dict[str, Any] = read_args_file(args.config) if args.config else {}
    if args.model is not None or ("model" not in data and "engine" not in data):
        data["model"] = args.model or "tiny"
    if args.replicas is not None or "num_replicas" not in data:
        data["num_replicas"] = 2 if args.replicas is None else args.replicas
    for key in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    if getattr(args, "dtype", None) is not None:
        engine = data.get("engine")
        if isinstance(engine, str):  # the model's shorthand
            data.setdefault("model", engine)
            engine = {}
        data["engine"] = {**(engine or {}), "dtype": args.dtype}
    return data


def dashboard_access() -> str:
    """How to open the Ray dashboard of the Ray this process started: Ray 2.60 turns token
    auth on unless RAY_AUTH_MODE says otherwise, and the dashboard then asks for the token."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return "no token needed (Ray's token auth is off)"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return (
        f"it asks for Ray's token: `ray get-auth-token` prints it (file {path});\n"
        "              for local use only, RAY_AUTH_MODE=disabled fairbatch serve turns it off"
    )


def banner(
    url: str, model: str, dashboard: str | None, anonymous: bool, tiny: bool, access: str
) -> str:
    key = "EMPTY" if anonymous else "<your API key>"
    note = (
        "\n  model:      the embedded tiny Llama has RANDOM weights: fast and exact, but its"
        "\n              text is noise; --model PATH serves a Hugging Face checkpoint"
        if tiny
        else ""
    )
    dash = f"{dashboard}   (Serve tab; metrics: docs/SERVE.md)\n              {access}"
    return f"""
fairbatch is serving {model!r}
  API:        {url}/v1   (health: {url}/health)
  dashboard:  {dash if dashboard else "(not running)"}{note}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -H 'Authorization: Bearer {key}' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "{EXAMPLE_PROMPT}"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key}'); \\
print(c.chat.completions.create(model='{model}', \\
messages=[{{'role': 'user', 'content': '{EXAMPLE_PROMPT}'}}]).choices[0].message.content)"

Ctrl-C stops it.
""".rstrip()


def direct_ingress_env(port: int) -> None:
    """Ray Serve's direct ingress for the local Ray `fairbatch serve` starts: no HTTP proxy, the
    ingress replica listens on `port` itself (the next ports for more ingress replicas): one
    hop less per streamed chunk. Variables already set win. Read by Ray when it starts, so this
    must run before `ray.init`."""
    os.environ.setdefault("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(port))
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", str(port + 64))
    # no load balancer to deregister from: a stopping ingress need not stay up 30 s
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    # the app's code on the event loop that serves HTTP: no thread hop per message
    os.environ.setdefault("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0")


def worker_priority_env() -> None:
    """Ray runs its worker processes (replicas, controller, ingress) at niceness 15 by default
    (`worker_niceness`), so any ordinary process on the same machine - a load generator, a
    script, a build - takes the CPU first. On a machine whose job is serving that inverts the
    priorities: the ingress's event loop then waits behind a busy client. `fairbatch serve`
    starts a Ray of its own, so its workers get the niceness of the process that starts it. A
    set variable wins. Read by Ray when it starts: call before `ray.init`."""
    os.environ.setdefault("RAY_worker_niceness", "0")


def grpc_handles_env() -> None:
    """Serve handles call over gRPC instead of through Ray's object store
    (`RAY_SERVE_USE_GRPC_BY_DEFAULT`, Ray 2.60): for the handle API's callers in this Ray (other
    Serve apps, this process): less CPU per streamed item for the caller and the ingress. Read
    when `ray.serve` is imported: call before that. A set variable wins."""
    os.environ.setdefault("RAY_SERVE_USE_GRPC_BY_DEFAULT", "1")


def serve_env(port: int, proxy: bool = False) -> None:
    """The environment `fairbatch serve` starts its Ray in (the tests and the serving-path
    benchmark start theirs the same way): the app at its starter's niceness, handles over
    gRPC, and direct ingress on `port` unless `proxy`. Call before `ray.init`."""
    worker_priority_env()
    grpc_handles_env()
    if not proxy:
        direct_ingress_env(port)


def _spare_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1" if host in ("0.0.0.0", "::") else host, 0))
        return s.getsockname()[1]


def _port_taken(host: str, port: int) -> bool:
    """Whether something already listens on (host, port): Serve would then quietly take the
    next port of its range, and the clients set up for this one would find nothing."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def run(args: argparse.Namespace) -> int:
    from fairbatch.deployments.serve.app import APP_NAME, ENGINES, ConfigError, parse_app_args

    try:
        data = app_args(args)
        config = parse_app_args(data)
        if config.model not in ENGINES and not os.path.isdir(config.model):
            # (the replicas load it on this machine: say so before starting Ray)
            raise ConfigError(f"model: no such model directory {config.model!r}")
        if _port_taken(args.host, args.port):
            raise ConfigError(f"--port: {args.host}:{args.port} is in use; pick another port")
    except ConfigError as e:
        print(f"fairbatch serve: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    serve_env(args.port, args.proxy)
    # Ctrl-C and SIGTERM both end in the same clean shutdown, also during start-up.
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    import ray
    from ray import serve

    from fairbatch.deployments.serve.app import build_app, ingress_url

    n = config.num_replicas if config.num_replicas != "auto" else 2
    init: dict[str, Any] = {
        "address": "local",  # always a new local Ray, never someone's running cluster
        "include_dashboard": True,
        "dashboard_host": "127.0.0.1",
        "log_to_driver": args.verbose,
    }
    if not cuda_available() and config.num_gpus_per_replica > 0:
        init["num_gpus"] = int(n * config.num_gpus_per_replica + 0.999)  # fake GPUs
    code = 0
    try:
        ctx = ray.init(**init)
        # ray.init puts its own SIGTERM handler in (a stack dump, then abort: exit 134); ours
        # goes back, so SIGTERM (`kill`, systemd, docker stop) shuts down as Ctrl-C does.
        signal.signal(signal.SIGTERM, _raise_stop)
        # Direct ingress: the ingress replica takes --port itself. Ray 2.60 still starts an
        # (idle) proxy; it gets a spare port.
        proxy_port = args.port if args.proxy else _spare_port(args.host)
        serve.start(http_options={"host": args.host, "port": proxy_port})
        print(f"starting {n} replica(s) of {config.model!r}...", flush=True)
        serve.run(build_app(data), name=APP_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        # with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 there is no proxy: the ingress has its own port
        url = ingress_url(APP_NAME, f"http://{host}:{proxy_port}")
        dashboard = f"http://{ctx.dashboard_url}" if ctx.dashboard_url else None
        if config.anonymous_risk is not None:
            print(f"WARNING: {config.anonymous_risk}", file=sys.stderr, flush=True)
        text = banner(url, config.model_name, dashboard, bool(config.allow_anonymous),
                      config.model == "tiny", dashboard_access())  # fmt: skip
        print(text, flush=True)
        while True:
            time.sleep(1.0)
    except _Stop:
        print("\nstopping fairbatch...", flush=True)
    except Exception as e:
        print(f"fairbatch serve failed: {e}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
        print("stopped.", flush=True)
    return code


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {port}")
    return port


def add_parser(sub: Any) -> None:
    from fairbatch.deployments.api.reasoning import PARSERS as REASONING_PARSERS
    from fairbatch.deployments.api.tool_parsers import PARSERS

    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible server on a local Ray (Ctrl-C stops it)"
    )
    p.add_argument("--config", help="YAML with the app args (or a Serve config holding them)")
    p.add_argument("--model", help="tiny (default), sim, or a Hugging Face model directory")
    p.add_argument("--replicas", type=int, help="replica actors, one GPU each (default 2)")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the model's dtype (default auto: bfloat16 on CUDA; on CPU the checkpoint's, "
        "bfloat16 where the CPU computes it natively, else float32; config: engine.dtype)",
    )
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    p.add_argument("--verbose", action="store_true", help="show the Ray workers' logs")
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        help="the model's tool-call format for tool_choice 'auto' (config: tool_call_parser)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="return a reasoning model's thinking as reasoning_content (config: reasoning_parser)",
    )
    p.add_argument(
        "--proxy",
        action="store_true",
        help="put Serve's HTTP proxy in front of the ingress (default: direct ingress, the "
        "ingress replica listens on --port itself)",
    )
    p.set_defaults(func=run)
