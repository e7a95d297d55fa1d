"""`build_app(args)`: the one builder for Python (`serve.run(build_app({...}))`) and YAML
(`import_path: fairbatch.deployments.serve.app:build_app` with `args:` in a Serve config).

The args are validated here, at the boundary, by `ServeAppConfig`: the API's `AppConfig`
(model, tenants, keys, limits) plus the cluster's settings. Every error names its field
(`engine.max_num_seqs: ...`) and unknown fields are errors, so a typo in a YAML file stops the
deploy instead of being ignored.

    from ray import serve
    from fairbatch.deployments.serve.app import build_app

    serve.run(build_app({"model": "tiny", "num_replicas": 2}), name="fairbatch")
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from fairbatch.deployments.api.config import AppConfig, ConfigError, format_validation_error

APP_NAME = "fairbatch"  # the Serve application name the docs and `get_app_handle` use
ENGINES = ("tiny", "sim")  # besides a model directory


def _dataclass_fields(cls: type, exclude: tuple[str, ...]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name not in exclude}


def _check_dataclass_kwargs(
    cls: type, kwargs: dict[str, Any], what: str, exclude: tuple[str, ...] = ("tenants",)
) -> dict[str, Any]:
    """Validate `kwargs` for `cls(**kwargs)` (a stdlib dataclass) with messages naming keys;
    the fields in `exclude` are not the user's to set there."""
    known = _dataclass_fields(cls, exclude)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"unknown {what} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        TypeAdapter(cls).validate_python(kwargs)
    except ValidationError as e:
        raise ValueError(format_validation_error(e).replace("\n", "; ")) from None
    except (TypeError, ValueError) as e:  # the dataclass's own __post_init__ checks
        raise ValueError(str(e)) from None
    return kwargs


def _check_policy(kwargs: dict[str, Any], default: str, what: str) -> None:
    """`policy` and `policy_kwargs` (e.g. dlpm's quantum) must build a policy."""
    from fairbatch.policies import make_policy

    try:
        make_policy(kwargs.get("policy", default), (), **kwargs.get("policy_kwargs", {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}.policy / policy_kwargs: {e}") from None


class ServeAppConfig(AppConfig):
    """`AppConfig` plus the cluster behind the ingress.

    * `model`: "tiny" (the embedded model), "sim" (simulated runner: fast, gibberish tokens
      from the tiny tokenizer's vocabulary) or a Hugging Face model directory present on
      every node.
    * `engine`: a string is shorthand for `model`; a mapping holds `ReplicaConfig` settings
      (`num_gpu_blocks`, `max_num_seqs`, `max_model_len`, `device`: "auto" | "cpu" | "cuda", ...).
    * `num_replicas`: replica actors (one GPU each); "auto" = the GPUs in the cluster at
      deploy time (at least 1).
    * `controller`: `ControllerConfig` settings (routing, policy, preemption, ...).
    * `autoscaling`: `AutoscalingConfig` settings (min_replicas, max_replicas,
      target_queued_tokens_per_replica, target_kv_usage, upscale_delay_s, downscale_delay_s,
      ...); the controller then sizes the replica set, starting from `num_replicas` clamped to
      [min_replicas, max_replicas] ("auto": min_replicas). None: a fixed set.
    """

    engine: dict[str, Any] | str = Field(default_factory=dict)  # type: ignore[assignment]
    num_replicas: int | Literal["auto"] = "auto"  # type: ignore[assignment]
    cluster_name: str = Field(default="fairbatch", pattern=r"^[A-Za-z0-9_\-]{1,40}$")
    num_gpus_per_replica: float = Field(default=1.0, ge=0)  # 0: CPU replicas, no GPU needed
    ingress_replicas: int = Field(default=1, ge=1)
    # Serve's access log: one line per request (method, route, status, latency) in the ingress's
    # log and on the console of every driver that shows worker logs. Off: that is CPU per request
    # in the ingress, Ray's log monitor and the drivers, which the metrics already count.
    access_log: bool = False
    startup_timeout_s: float = Field(default=600.0, gt=0)  # cluster up (models loaded)
    request_timeout_s: float = Field(default=300.0, gt=0)  # admission wait, and between tokens
    # A request the fairness controller has not taken within this (it is restarting, or down)
    # ends with 503 + Retry-After; once it holds the request, queueing is bounded by the
    # request's max_queue_time_s and by request_timeout_s.
    admission_timeout_s: float = Field(default=30.0, gt=0)
    metrics_interval_s: float = Field(default=1.0, ge=0)  # gauges refresh; 0 = no metrics
    autoscaling: dict[str, Any] | None = None

    @field_validator("num_replicas")
    @classmethod
    def _replicas(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return v

    @field_validator("controller")
    @classmethod
    def _controller(cls, v: dict[str, Any]) -> dict[str, Any]:
        from fairbatch.deployments.cluster.tickets import APP_SETTINGS, ControllerConfig

        v = _check_dataclass_kwargs(ControllerConfig, v, "controller", ("tenants", *APP_SETTINGS))
        _check_policy(v, "priority", "controller")
        return v

    @field_validator("autoscaling")
    @classmethod
    def _autoscaling(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from fairbatch.deployments.cluster.autoscaling import AutoscalingConfig

        return None if v is None else _check_dataclass_kwargs(AutoscalingConfig, v, "autoscaling")

    @model_validator(mode="after")
    def _engine(self) -> ServeAppConfig:
        from fairbatch.deployments.cluster.replica import ReplicaConfig

        engine = self.engine
        if isinstance(engine, str):
            object.__setattr__(self, "model", engine)
            engine = {}
        engine = dict(engine)
        kind = engine.pop("engine", None)
        if kind is not None:
            if not isinstance(kind, str) or not kind:
                raise ValueError("engine.engine: must be 'tiny', 'sim' or a model directory")
            object.__setattr__(self, "model", kind)
        try:
            _check_dataclass_kwargs(ReplicaConfig, {**engine, "engine": self.model}, "engine")
        except ValueError as e:
            raise ValueError(f"engine: {e}") from None
        _check_policy(engine, "priority", "engine")
        if self.lora_adapters and not engine.get("max_loras"):
            raise ValueError("lora_adapters: set engine.max_loras (adapter slots per replica)")
        object.__setattr__(self, "engine", engine)
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model in ENGINES:
            return f"fairbatch-{self.model}"
        return super().model_name

    def replica_config(self) -> Any:
        from fairbatch.deployments.cluster.replica import ReplicaConfig

        kw: dict[str, Any] = {"device": "auto", "max_num_seqs": 16, "num_gpu_blocks": 512}
        if self.model == "sim":
            from fairbatch.engine.tokenizer import Tokenizer

            kw["sim_vocab"] = Tokenizer.tiny().vocab_size
        kw.update(self.engine)
        return ReplicaConfig(engine=self.model, tenants=self.kv_share_specs(), **kw)

    def controller_config(self) -> Any:
        from fairbatch.deployments.cluster.fairness import ControllerConfig
        from fairbatch.deployments.cluster.limits import LimitsSpec, TenantLimit

        limits = LimitsSpec(
            {t.name: TenantLimit(t.tokens_per_minute, t.max_requests) for t in self.tenants},
            self.limits.max_requests_per_tenant,
            self.limits.max_requests_total,
            self.limits.retry_after_s,
        )
        usage = None if self.usage is None else self.usage.spec()
        return ControllerConfig(
            **self.controller, limits=limits, usage=usage, usage_model=self.model_name
        )

    def autoscaling_config(self) -> Any:
        from fairbatch.deployments.cluster.autoscaling import AutoscalingConfig

        return None if self.autoscaling is None else AutoscalingConfig(**self.autoscaling)

    def initial_replicas(self) -> int | str:
        """`num_replicas`, within the autoscaling bounds when there are some."""
        scaling = self.autoscaling_config()
        if scaling is None:
            return self.num_replicas
        if self.num_replicas == "auto":
            return scaling.min_replicas
        return min(max(self.num_replicas, scaling.min_replicas), scaling.max_replicas)

    def kv_share_specs(self) -> list[Any]:
        """The tenants with a kv_share, for the replicas' engines (set when they are built, so
        a changed share starts a new cluster; weights and priorities are pushed at start)."""
        from fairbatch.policies import TenantSpec

        return [TenantSpec(t.name, kv_share=t.kv_share) for t in self.tenants if t.kv_share]


def read_args_file(path: str | Path) -> dict[str, Any]:
    """The app args in a YAML file: at top level, under `args:`, or a whole Serve config
    (the args of its application whose import path is this module's `build_app`)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    if isinstance(data, dict) and "applications" in data:
        apps = [
            a
            for a in data.get("applications") or []
            if isinstance(a, dict) and str(a.get("import_path", "")).endswith(":build_app")
        ]
        if not apps:
            raise ConfigError(f"{path}: no application with import_path ...app:build_app")
        data = apps[0].get("args") or {}
    elif isinstance(data, dict) and set(data) == {"args"}:
        data = data["args"] or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the app args must be a mapping")
    return data


def parse_app_args(args: dict[str, Any] | ServeAppConfig | None) -> ServeAppConfig:
    """Validate `build_app` args; ConfigError names every field at fault."""
    if isinstance(args, ServeAppConfig):
        return args
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ConfigError(f"app args must be a mapping, got {type(args).__name__}")
    args = dict(args)
    config_file = args.pop("config_file", None)
    if config_file is not None:  # args given next to the file win over the file's
        args = {**read_args_file(config_file), **args}
    try:
        return ServeAppConfig.model_validate(args)
    except ValidationError as e:
        raise ConfigError(
            "invalid fairbatch app args:\n" + format_validation_error(e, "  ")
        ) from None


def _env_on(name: str) -> bool:
    import os

    return os.environ.get(name, "0").lower() in ("1", "true")


def ingress_url(app_name: str, proxy_url: str, timeout_s: float = 60.0) -> str:
    """Where the app's HTTP requests go: Serve's proxy (`proxy_url`), or, with direct ingress
    (`RAY_SERVE_ENABLE_DIRECT_INGRESS=1`, also on under `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: no
    proxy), the ingress replica's own port as Serve's controller lists it (Ray 2.60 takes it
    from `RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`.., 30000-31000)."""
    import time

    import ray
    from ray.serve._private import constants

    # the environment, not only the constant: it may have been set after Serve was imported
    # here (the Serve controller reads it when Ray starts it)
    if not (
        constants.RAY_SERVE_ENABLE_DIRECT_INGRESS or _env_on("RAY_SERVE_ENABLE_DIRECT_INGRESS")
    ):
        return proxy_url
    controller = ray.get_actor(constants.SERVE_CONTROLLER_NAME, namespace=constants.SERVE_NAMESPACE)
    proxy_port = int(proxy_url.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for group in ray.get(controller.get_target_groups.remote(app_name), timeout=30):
            if str(group.protocol).upper().endswith("HTTP"):
                ports = [t.port for t in group.targets if t.port != proxy_port]
                if ports:
                    host = proxy_url.rsplit(":", 1)[0]
                    return f"{host}:{ports[0]}"
        time.sleep(0.5)
    raise RuntimeError(f"direct ingress: Serve lists no HTTP port for app {app_name!r}")


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The fairbatch Serve application (an ingress deployment bound to its args)."""
    from fairbatch.deployments.serve.ingress import FairbatchIngress

    config = parse_app_args(args)
    return FairbatchIngress.options(
        num_replicas=config.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": config.access_log},
    ).bind(config.model_dump())
