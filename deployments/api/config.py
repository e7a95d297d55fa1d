"""The app's configuration: tenants, keys and limits, validated once at the boundary.

`AppConfig` is the pydantic model for the app args (a Python dict or the YAML `args:` of a
Serve config). Every error names the field it is about (`tenants.1.weight: ...`), and unknown
fields are errors, so a typo in a YAML file fails at start-up instead of being ignored.

Keys: a tenant's `api_key` is hashed (sha256) when the config is loaded and only the digest is
kept; `api_key_sha256` (64 hex digits) lets a config file hold no plain key at all. The same
holds for the admin key. Once any tenant has a key, a request without one is refused unless the
config turns anonymous access on by name. Nothing here imports torch or ray.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fairbatch.engine.sampling_params import MAX_DEADLINE_S

SHA256_HEX = r"^[0-9a-fA-F]{64}$"
NAME = r"^[A-Za-z0-9_.\-]+$"  # tenant and prefix-cache group names


def sha256_hex(key: str) -> str:
    """The lower-case hex sha256 digest of an API key (UTF-8)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TenantConfig(_Strict):
    """One tenant: who it is (a key), its share, its class and its quota."""

    name: str = Field(min_length=1, max_length=64, pattern=NAME)
    api_key: str | None = Field(default=None, min_length=1, repr=False)  # hashed on load
    api_key_sha256: str | None = Field(default=None, pattern=SHA256_HEX, repr=False)
    weight: float = Field(default=1.0, gt=0, le=1e6)  # share under weighted fair scheduling
    priority: int = Field(default=0, ge=-1000, le=1000)  # higher = more important
    tokens_per_minute: float | None = Field(default=None, gt=0)  # None = unlimited
    # fraction of each replica's GPU KV blocks kept for this tenant: its blocks up to it are
    # never preempted for another tenant, and its cached prefixes are evicted last
    kv_share: float | None = Field(default=None, gt=0, le=1)
    max_requests: int | None = Field(default=None, ge=1)  # in flight; None = limits' default
    # deadlines for requests that set none (`timeout`, `max_queue_time_s`), in seconds
    default_timeout_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    max_queue_time_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    # Tenants naming the same group share prefix-cache blocks, so each can time the others'
    # prompts (a hit is faster): opt in only between tenants that trust each other. None: the
    # tenant's own cache, shared with nobody.
    prefix_cache_group: str | None = Field(default=None, min_length=1, max_length=64, pattern=NAME)

    @model_validator(mode="after")
    def _hash_key(self) -> TenantConfig:
        if self.api_key is not None and self.api_key_sha256 is not None:
            raise ValueError("give api_key or api_key_sha256, not both")
        if self.api_key is not None:
            digest = sha256_hex(self.api_key)
            # Keep only the digest: the plain key never lives past validation.
            object.__setattr__(self, "api_key", None)
            object.__setattr__(self, "api_key_sha256", digest)
        elif self.api_key_sha256 is not None:
            object.__setattr__(self, "api_key_sha256", self.api_key_sha256.lower())
        return self


class LimitsConfig(_Strict):
    """Bounds that keep one client (or all of them) from exhausting the ingress."""

    max_body_bytes: int = Field(default=1 << 20, ge=1024)  # larger bodies: 413, never parsed
    # In flight (queued or running) per tenant, else 429; overall, else 503. Generous: under a
    # fair scheduler a tenant's burst waits its turn in the queue (or its own deadline) rather
    # than bouncing; these bound only the ingress's memory and a runaway client.
    max_requests_per_tenant: int = Field(default=1024, ge=1)
    max_requests_total: int = Field(default=4096, ge=1)
    retry_after_s: int = Field(default=1, ge=1, le=3600)  # Retry-After for full queues
    max_model_len: int | None = Field(default=None, ge=2)  # None = the backend's own limit
    default_max_tokens: int = Field(default=256, ge=1)  # chat requests without max_tokens
    max_stop_sequences: int = Field(default=4, ge=1, le=64)  # OpenAI allows 4
    max_prompts_per_request: int = Field(default=64, ge=1, le=4096)  # /v1/completions batches


class LoRAAdapterConfig(_Strict):
    """A LoRA adapter served as a model: requests whose `model` is `name` run it."""

    name: str = Field(min_length=1, max_length=128, pattern=NAME)
    path: str = Field(min_length=1)  # a PEFT adapter directory every replica can read
    tenants: list[str] | None = None  # who may use it; None: every tenant


class MetricsConfig(_Strict):
    """GET /metrics (Prometheus text). Open by default: `fairbatch serve` binds loopback, so
    whoever can reach the port can read it (tenant names and load, never keys or text)."""

    enabled: bool = True
    require_admin_key: bool = False  # 401 without the admin key, as the admin routes


class UsageConfig(_Strict):
    """The usage log (deployments/usage.py): one JSON line per request that ended, at `path`
    on the head node (a cluster's fairness controller writes it), rotated at `max_bytes` with
    `backups` older files kept."""

    path: str = Field(min_length=1)
    max_bytes: int = Field(default=64 << 20, ge=1024)
    backups: int = Field(default=10, ge=0, le=1000)

    def spec(self) -> Any:
        from fairbatch.deployments.usage import UsageSpec

        return UsageSpec(self.path, self.max_bytes, self.backups)


class AppConfig(_Strict):
    """The app args. The embedded default (`AppConfig()`) serves the tiny model to anyone."""

    model: str = Field(default="tiny", min_length=1)  # "tiny" or a HF model directory
    served_model_name: str | None = Field(default=None, min_length=1)  # the API's `model` id
    tenants: list[TenantConfig] = Field(default_factory=list)
    # Requests without a key run as `anonymous_tenant`. Unset: allowed only while no tenant has
    # a key (configuring keys means every request needs one, as vLLM's --api-key does).
    allow_anonymous: bool | None = None
    anonymous_tenant: str = Field(default="default", min_length=1, max_length=64)
    admin_api_key: str | None = Field(default=None, min_length=1, repr=False)  # hashed on load
    admin_api_key_sha256: str | None = Field(default=None, pattern=SHA256_HEX, repr=False)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    # A streamed request's deltas that arrive within this many ms of its last chunk leave as
    # one SSE chunk (0 = a chunk per delta); the first token always leaves at once.
    stream_interval_ms: float = Field(default=50.0, ge=0, le=1000)
    # The model's tool-call format, for `tool_choice: "auto"` (deployments/api/tool_parsers.py):
    # "hermes" (Qwen2, Qwen2.5, Hermes), "llama3_json" (Llama 3.1+), "mistral" or "pythonic"
    # (Llama 3.2, Llama 4). None: "auto" is a 400.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = None
    # Chat replies of a reasoning model: "deepseek_r1" returns the text up to </think> as
    # `reasoning_content` (deployments/api/reasoning.py); "qwen3" the same for an output that
    # opens with <think> (none with enable_thinking false). None: the output is the content.
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    # LoRA adapters served as models besides the base model (the engine needs max_loras > 0)
    lora_adapters: list[LoRAAdapterConfig] = Field(default_factory=list)
    usage: UsageConfig | None = None  # None: no usage records are kept
    # Cluster-layer settings (replicas, routing, engine kwargs) are passed through untouched
    # for the app builder; the ingress itself does not read them.
    num_replicas: int = Field(default=1, ge=1)
    engine: dict[str, Any] = Field(default_factory=dict)  # build_engine kwargs
    controller: dict[str, Any] = Field(default_factory=dict)  # ControllerConfig kwargs

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.admin_api_key is not None and self.admin_api_key_sha256 is not None:
            raise ValueError("give admin_api_key or admin_api_key_sha256, not both")
        if self.admin_api_key is not None:
            object.__setattr__(self, "admin_api_key_sha256", sha256_hex(self.admin_api_key))
            object.__setattr__(self, "admin_api_key", None)
        elif self.admin_api_key_sha256 is not None:
            object.__setattr__(self, "admin_api_key_sha256", self.admin_api_key_sha256.lower())
        if self.metrics.require_admin_key and self.admin_api_key_sha256 is None:
            raise ValueError("metrics.require_admin_key: no admin key is configured")
        if self.allow_anonymous is None:
            keyed = any(t.api_key_sha256 is not None for t in self.tenants)
            object.__setattr__(self, "allow_anonymous", not keyed)
        shares = sum(t.kv_share or 0.0 for t in self.tenants)
        if shares > 1 + 1e-9:
            raise ValueError(f"tenants: kv_share values sum to {shares:g}, more than 1")
        names: set[str] = set()
        digests: set[str] = set()
        for i, t in enumerate(self.tenants):
            if t.name in names:
                raise ValueError(f"tenants.{i}.name: duplicate tenant name {t.name!r}")
            names.add(t.name)
            if t.api_key_sha256 is not None:
                if t.api_key_sha256 in digests:
                    raise ValueError(f"tenants.{i}: the same API key is given to two tenants")
                if t.api_key_sha256 == self.admin_api_key_sha256:
                    raise ValueError(f"tenants.{i}: a tenant key must differ from the admin key")
                digests.add(t.api_key_sha256)
        adapters: set[str] = set()
        for i, a in enumerate(self.lora_adapters):
            if a.name in adapters or a.name == self.model_name:
                raise ValueError(f"lora_adapters.{i}.name: {a.name!r} names another model")
            adapters.add(a.name)
            unknown = sorted(set(a.tenants or ()) - names - {self.anonymous_tenant})
            if unknown:
                raise ValueError(f"lora_adapters.{i}.tenants: unknown tenants {unknown}")
        return self

    @property
    def anonymous_risk(self) -> str | None:
        """A warning for start-up logs when keys are configured and anonymous access is on
        anyway (explicitly): anyone who can reach the port is served, as that tenant."""
        keyed = [t.name for t in self.tenants if t.api_key_sha256 is not None]
        if not (self.allow_anonymous and keyed):
            return None
        return (
            f"allow_anonymous is true although tenants {', '.join(keyed)} have API keys: "
            f"requests without a key are served as tenant {self.anonymous_tenant!r}, "
            "by anyone who can reach this port"
        )

    @property
    def model_name(self) -> str:
        """The id clients put in `model`: `served_model_name`, else the model's last path part."""
        if self.served_model_name:
            return self.served_model_name
        return "fairbatch-tiny" if self.model == "tiny" else Path(self.model).name or self.model


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every offending field."""


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem: `field.path: message`."""
    lines = []
    for e in err.errors(include_url=False, include_input=False):
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{prefix}{loc}: {msg}" if loc else f"{prefix}{msg}")
    return "\n".join(lines)


def parse_config(args: dict[str, Any] | AppConfig | None) -> AppConfig:
    """Validate app args; raises ConfigError naming the fields at fault."""
    if isinstance(args, AppConfig):
        return args
    if args is None:
        return AppConfig()
    if not isinstance(args, dict):
        raise ConfigError(f"app config must be a mapping, got {type(args).__name__}")
    try:
        return AppConfig.model_validate(args)
    except ValidationError as e:
        raise ConfigError("invalid app config:\n" + format_validation_error(e, "  ")) from None


def load_config(path: str | Path) -> AppConfig:
    """Read a YAML file holding the app args (at top level or under `args:`)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if isinstance(data, dict) and set(data) == {"args"}:
        data = data["args"] or {}
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
