"""A real Prometheus scrapes a real fairbatch: every PromQL expression of
deployments/grafana_dashboard.json must return at least one series.

A local Ray (dashboard on: its reporter writes Prometheus' service-discovery file in the session
dir) serves the app on two simulated-runner replicas with a small KV cache, so a short load of
completions also preempts and swaps; a tenant with a tiny quota gets 429s. Prometheus (the
`prometheus` binary; skipped without it) listens on 127.0.0.1, scrapes every second the targets
of Ray's `prom_metrics_service_discovery.json` (their host rewritten to 127.0.0.1: one machine,
loopback only), and keeps its TSDB under tmp_path.

Grafana variables are replaced before querying: `$session` by this Ray's session name (so the
expression's label filter is checked against the labels Ray really attaches), any other
template variable by `.+` (dashboard variables are multi-value: used with `=~`), and the
interval macros (`$__rate_interval`, `$__interval`, `$__range`) by `1m`. The `session`
variable's own `label_values(...)` query is checked through Prometheus' label API.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray")
from loopback import free_port, run_serve_app, wait_for  # noqa: E402

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="no `prometheus` binary on PATH (Debian/Ubuntu: apt-get install prometheus)",
)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deployments" / "grafana_dashboard.json"
SD_FILE = "prom_metrics_service_discovery.json"
QUERY_DEADLINE_S = 60.0
INTERVAL_MACROS = ("$__rate_interval", "${__rate_interval}", "$__interval", "$__range")
KEYS = {"a": "sk-a", "b": "sk-b", "q": "sk-q"}


def app_args() -> dict:
    return {
        "model": "sim",
        "num_replicas": 2,
        "cluster_name": "fbprom",
        "metrics_interval_s": 0.5,
        "engine": {
            # 8 blocks of 16 tokens for 4 seats of ~80 tokens: the KV cache runs out, so
            # requests are preempted (swapped out to the CPU blocks and back)
            "num_gpu_blocks": 8,
            "num_cpu_blocks": 64,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 256,
            "max_model_len": 512,
            "time_scale": 3.0,  # paced steps: requests overlap
        },
        "tenants": [
            {"name": "a", "api_key": KEYS["a"], "weight": 1.0},
            {"name": "b", "api_key": KEYS["b"], "weight": 2.0},
            {"name": "q", "api_key": KEYS["q"], "tokens_per_minute": 30},  # 429s
        ],
    }


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every query target of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    for macro in INTERVAL_MACROS:
        expr = expr.replace(macro, "1m")
    for name, value in variables.items():
        for form in (f"${{{name}}}", f"[[{name}]]", f"${name}"):
            expr = expr.replace(form, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def prometheus_config(sd_path: Path) -> dict:
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "ray",
                "file_sd_configs": [{"files": [str(sd_path)], "refresh_interval": "1s"}],
                "relabel_configs": [
                    {
                        "source_labels": ["__address__"],
                        "regex": r".+:(\d+)",
                        "target_label": "__address__",
                        "replacement": "127.0.0.1:$1",
                    }
                ],
            }
        ],
    }


class Prometheus:
    def __init__(self, workdir: Path, sd_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(sd_path)))
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log_tail()}")
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

        wait_for(ready, timeout_s, "prometheus /-/ready")

    def api(self, path: str, **params) -> object:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        assert body.get("status") == "success", body
        return body["data"]

    def num_series(self, expr: str) -> int:
        return len(self.api("query", query=expr)["result"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def ray_with_app():
    """A local Ray of its own (short private temp dir: Ray's socket paths have a length limit),
    workers reporting metrics every second, and the app on it. Yields (base URL, session dir)."""
    tmp = tempfile.mkdtemp(prefix="fbprom-", dir="/tmp")
    saved = os.environ.get("RAY_agent_register_timeout_ms")
    # a loaded 2-core box can take longer than Ray's 30 s to start the metrics agent
    os.environ["RAY_agent_register_timeout_ms"] = "120000"
    try:
        ray.init(
            num_cpus=2,
            num_gpus=2,
            include_dashboard=True,  # its reporter writes the service-discovery file
            dashboard_host="127.0.0.1",
            dashboard_port=free_port(),
            _metrics_export_port=free_port(),
            _temp_dir=tmp,
            _system_config={"metrics_report_interval_ms": 1000},
            log_to_driver=False,
            configure_logging=False,
        )
        base = run_serve_app(app_args(), free_port(), timeout_s=120)
        yield base, Path(tmp) / "session_latest"
    finally:
        try:
            from ray import serve

            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_agent_register_timeout_ms", None)
        else:
            os.environ["RAY_agent_register_timeout_ms"] = saved
        shutil.rmtree(tmp, ignore_errors=True)


def find_sd_file(session_dir: Path, metrics_port: int) -> Path:
    """Ray's service-discovery file, once it lists this node's metrics export port."""

    def found() -> Path | None:
        for path in [session_dir / SD_FILE, *session_dir.glob(f"**/{SD_FILE}")]:
            if path.is_file():
                groups = json.loads(path.read_text())
                targets = [t for g in groups for t in g["targets"]]
                if any(t.endswith(f":{metrics_port}") for t in targets):
                    return path
        return None

    return wait_for(found, 30, f"{SD_FILE} listing port {metrics_port} in {session_dir}")


def run_load(base: str) -> None:
    """Completions from tenants a and b at once (KV pressure: preemptions, swaps), and a burst
    from q over its quota (429s)."""

    def complete(i: int, tenant: str) -> int:
        r = httpx.post(
            f"{base}/v1/completions",
            headers={"Authorization": f"Bearer {KEYS[tenant]}"},
            json={
                "model": "fairbatch-sim",
                "prompt": f"request {i} " + "hello world " * (3 + i % 4),
                "max_tokens": 60,
                "ignore_eos": True,
            },
            timeout=60,
        )
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(complete, range(12), ["a", "b"] * 6))
    assert codes == [200] * 12, codes
    quota = [complete(100 + i, "q") for i in range(4)]
    assert 429 in quota, quota


def test_dashboard_metrics_are_the_exported_ones():
    """Every metric the dashboard queries is in deployments/metrics.py's table of exported
    names (a histogram by its _bucket series). Also covers a counter the load below does not
    move (migrations: the panel reads 0 through `or on() vector(0)` until one happens)."""
    from fairbatch.deployments import metrics

    exported = set(re.findall(r"^\| (ray_fairbatch_\w+) \| (\w+) \|", metrics.__doc__, re.M))
    names = {n if t != "histogram" else n + "_bucket" for n, t in exported}
    used = {m for _, e in dashboard_exprs() for m in re.findall(r"ray_fairbatch_\w+", e)}
    assert len(names) >= 15 and used, (names, used)
    assert used <= names, sorted(used - names)


@needs_prometheus
def test_every_dashboard_expression_returns_series(ray_with_app, tmp_path):
    base, session_dir = ray_with_app
    t0 = time.monotonic()
    metrics_port = ray.nodes()[0]["MetricsExportPort"]
    session = session_dir.resolve().name  # Ray's SessionName label: session_<date>_<pid>
    sd_path = find_sd_file(session_dir, metrics_port)
    prom = Prometheus(tmp_path, sd_path)
    try:
        prom.wait_ready()
        run_load(base)

        board = json.loads(DASHBOARD.read_text())
        # session names are letters, digits, _ and -: literal in a PromQL regex as they are
        assert re.fullmatch(r"session_[\w-]+", session), session
        variables = {}
        for var in board["templating"]["list"]:
            if var["type"] == "datasource":
                continue
            variables[var["name"]] = session if var["name"] == "session" else ".+"
        exprs = [(where, substitute(e, variables)) for where, e in dashboard_exprs()]
        assert len(exprs) >= 10, exprs

        empty = dict(exprs)
        deadline = time.monotonic() + QUERY_DEADLINE_S
        while empty and time.monotonic() < deadline:
            for where, expr in list(empty.items()):
                if prom.num_series(expr) > 0:
                    del empty[where]
            if empty:
                time.sleep(1.0)
        if empty:
            names = prom.api("label/__name__/values")
            ours = sorted(n for n in names if "fairbatch" in n)
            targets = prom.api("targets")["activeTargets"]
            health = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
            pytest.fail(
                f"{len(empty)} dashboard expression(s) returned no series after "
                f"{QUERY_DEADLINE_S:.0f} s:\n"
                + "\n".join(f"  {w}: {e}" for w, e in empty.items())
                + f"\nfairbatch metrics in Prometheus: {ours}\ntargets: {health}"
            )

        # the session variable's query, label_values(metric, label), lists this session
        for var in board["templating"]["list"]:
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", str(var.get("query", "")))
            if m:
                values = prom.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
                assert session in values, (var["name"], values)
        print(f"{len(exprs)} expressions with series, {time.monotonic() - t0:.1f} s after app up")
    finally:
        prom.stop()
