"""The OpenAI-compatible API as a Ray Serve ingress deployment, over the fairbatch cluster.

`FairbatchIngress` is a plain class under `@serve.ingress()`: its (async) constructor
validates the args, builds the FastAPI app (`create_app(None, config)`), starts or finds the
cluster (`cluster.launch.ensure_cluster`: the named controller and one replica actor per GPU,
`num_cpus=0`), binds a `ClusterBackend` to the app, and only then returns, so `serve.run` and
`serve status` report RUNNING when requests can be served. Serve gets the app from
`__serve_build_asgi_app__`. The handle API (`handle_api.HandleApi`) is mixed in.

On shutdown the ingress detaches from the cluster; the last ingress to go kills it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve

from fairbatch.deployments.api.server import bind_backend, create_app
from fairbatch.deployments.cluster.channel import own_process
from fairbatch.deployments.metrics import Deltas, get_metrics
from fairbatch.deployments.serve.handle_api import HandleApi
from fairbatch.engine.sampling_params import LoRARequest

log = logging.getLogger("fairbatch.serve")
ADMIN_SYNC_S = 1.0  # how often an ingress picks up admin changes made through another one
SYNC_TIMEOUT_S = 10.0


def load_tokenizer(model: str) -> Any:
    """The API's tokenizer: the tiny one for "tiny"/"sim", else the model directory's."""
    from fairbatch.engine.tokenizer import Tokenizer

    if model in ("tiny", "sim"):
        return Tokenizer.tiny()
    if not (Path(model) / "tokenizer.json").is_file():
        raise ValueError(f"model {model!r}: no tokenizer.json there; the API needs a tokenizer")
    return Tokenizer.from_dir(model)


def _hf_config(model: str) -> dict | None:
    """A model directory's config.json; None for the built-in models, or when unreadable."""
    if model in ("tiny", "sim"):
        return None
    try:
        return json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def model_max_len(model: str, configured: int) -> int:
    """The replica's `max_model_len`, capped by the model's own position limit."""
    cfg = _hf_config(model)
    if cfg is None:
        return configured
    try:
        return min(configured, int(cfg.get("max_position_embeddings") or configured))
    except ValueError:
        return configured


def model_salt_rule(model: str) -> Callable[[int, str], str] | None:
    """How the model's replicas salt a prompt's cached blocks by its length (its family's
    `CausalLM.cache_salt_rule`); None for models without one, or config.json unreadable."""
    from fairbatch.engine.models import model_class, read_config

    cfg = _hf_config(model)
    try:
        config = None if cfg is None else read_config(cfg)
        return None if config is None else model_class(config).cache_salt_rule(config)
    except (ValueError, KeyError):
        return None


def resolve_num_replicas(requested: int | str, gpus_per_replica: float) -> int:
    if requested != "auto":
        return int(requested)
    if gpus_per_replica <= 0:
        return 1
    gpus = ray.cluster_resources().get("GPU", 0.0)
    return max(1, int(gpus // gpus_per_replica))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress()
class FairbatchIngress(HandleApi):
    async def __init__(self, config: dict[str, Any]) -> None:
        from fairbatch.deployments.cluster.launch import ClusterSpec, ensure_cluster
        from fairbatch.deployments.serve.app import parse_app_args
        from fairbatch.deployments.serve.backend import ClusterBackend

        cfg = parse_app_args(config)
        self.config = cfg
        self.user = f"ingress-{uuid.uuid4().hex[:12]}"
        self.handles = None
        self._tasks: set[asyncio.Task] = set()
        self.api_app = create_app(None, cfg, shared_limits=True)  # the controller's
        tokenizer = load_tokenizer(cfg.model)
        replica_cfg = cfg.replica_config()
        n = resolve_num_replicas(cfg.initial_replicas(), cfg.num_gpus_per_replica)
        spec = ClusterSpec(
            name=cfg.cluster_name,
            replicas=[replica_cfg] * n,
            controller=cfg.controller_config(),
            num_gpus_per_replica=cfg.num_gpus_per_replica,
            metrics_interval_s=cfg.metrics_interval_s,
            autoscaling=cfg.autoscaling_config(),
        )
        log.info("starting or joining cluster %s: %d x %s", spec.cluster_id(), n, cfg.model)
        self.handles = await ensure_cluster(spec, cfg.startup_timeout_s)
        await self.handles.controller.attach.remote(self.user, own_process())
        # a cluster found running keeps its queue; the limits are this config's
        await self.handles.controller.set_limits.remote(spec.controller.limits)
        await self.handles.controller.set_usage.remote(
            spec.controller.usage, spec.controller.usage_model
        )
        tenants = sorted(self.api_app.state.registry.tenants)
        await self.handles.controller.set_tenants.remote(tenants)  # the ones it exports
        self.backend = ClusterBackend(
            self.handles,
            tokenizer,
            model_max_len(cfg.model, replica_cfg.max_model_len),
            block_size=replica_cfg.block_size,
            salt_rule=model_salt_rule(cfg.model),
            admit_timeout_s=cfg.request_timeout_s,
            item_timeout_s=cfg.request_timeout_s,
            admission_timeout_s=cfg.admission_timeout_s,
            record_metrics=cfg.metrics_interval_s > 0,
        )
        self._admin_version = 0
        await self._sync_admin()  # admin changes kept by the controller win over the config
        await bind_backend(self.api_app, self.backend)
        self._tasks.add(asyncio.get_running_loop().create_task(self._sync_admin_loop()))
        if cfg.metrics_interval_s > 0:
            task = asyncio.get_running_loop().create_task(self._metrics_loop())
            self._tasks.add(task)
        log.info("fairbatch ingress ready: model %s, %d replicas", cfg.model_name, n)

    def __serve_build_asgi_app__(self) -> Any:
        return self.api_app

    # No Serve `check_health`: a controller restart must not make Serve replace the ingress
    # (the last ingress to go stops the cluster). GET /health reports the cluster's state.

    async def cluster_stats(self) -> dict:
        """The controller's view (queue, assignments, counters): for operators and tests."""
        return await self.backend.stats()

    async def cluster_tenants(self) -> dict[str, tuple[float, int]]:
        """Tenant -> (weight, priority) as the cluster's global queue has them."""
        return await self.handles.controller.tenants.remote()

    async def replica_handles(self) -> dict[str, Any]:
        """The replicas in service now (replacements included), from the controller."""
        return await self.handles.controller.replica_handles.remote()

    async def _sync_admin(self) -> None:
        """Apply the admin changes the controller keeps, if any are newer than the last seen
        (a PATCH served by another ingress, or made before this one started)."""
        got = await asyncio.wait_for(
            self.handles.controller.admin_changes.remote(self._admin_version), SYNC_TIMEOUT_S
        )
        if got is None:
            return
        self._admin_version = got.version
        loras = self.api_app.state.api.loras
        for name, lora in got.loras.items():
            held = loras.entries.get(name)
            if lora is None:
                if held is not None:
                    loras.remove(name)
            elif held is None or held.lora.name != lora.engine_name:
                who = None if lora.tenants is None else frozenset(lora.tenants)
                loras.adopt(name, LoRARequest(lora.engine_name, lora.path), who)
        registry = self.api_app.state.registry
        for name, s in got.tenants.items():
            if name in registry.tenants:
                registry.update(
                    name, weight=s.weight, priority=s.priority,
                    tokens_per_minute=s.tokens_per_minute,
                    clear_quota=s.tokens_per_minute is None, max_requests=s.max_requests,
                    clear_max_requests=s.max_requests is None,
                )  # fmt: skip

    async def _sync_admin_loop(self) -> None:
        while True:
            await asyncio.sleep(ADMIN_SYNC_S)
            try:
                await self._sync_admin()
            except Exception as e:  # the controller is restarting: next time
                log.info("tenant sync failed: %r", e)

    async def _metrics_loop(self) -> None:
        m = get_metrics()
        deltas = Deltas()
        registry = self.api_app.state.registry
        while True:
            for t in list(registry.tenants.values()):
                deltas.inc(m.rejections, t.requests_rejected, {"tenant": t.name})
            await asyncio.sleep(self.config.metrics_interval_s)

    async def __del__(self) -> None:
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        handles = getattr(self, "handles", None)
        if handles is None:
            return
        from fairbatch.deployments.cluster.launch import kill_cluster

        try:
            left = await asyncio.wait_for(handles.controller.detach.remote(self.user), 10.0)
        except Exception as e:
            log.warning("detach from cluster %s failed: %r", handles.cluster_id, e)
            return
        if left == 0:
            log.info("last ingress gone: shutting down cluster %s", handles.cluster_id)
            kill_cluster(handles)
