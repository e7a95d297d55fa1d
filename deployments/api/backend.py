"""The OpenAI-compatible API: the backend protocol it calls, and a local backend for one engine.

`create_app(backend, config)` (in `api_server`, re-exported here) builds the FastAPI app
(`create_app(None, config)` + `await bind_backend(app, backend)` when the host must build the
app before the backend exists, as a Serve ingress class does). It
talks to whatever serves tokens through the `Backend` protocol below; `LocalBackend` wraps one
in-process `AsyncEngine` (tests, single-machine runs), and the Ray cluster layer provides
another implementation with the same protocol.

Backend protocol (duck-typed; only `generate`, `abort`, `tokenizer`, `max_model_len` required):

* `generate(prompt_token_ids, params, *, request_id, tenant, priority[, cache_salt])` -> an
  async iterator of `fairbatch.engine.outputs.RequestDelta`, ending with a delta whose `finished`
  is True (`finish_reason` "stop" | "length" | "abort" | "error"). Contract:
    - nothing is submitted before the first `__anext__`;
    - closing the iterator early (`aclose()`, or cancelling the task awaiting it) aborts the
      request and frees its KV blocks;
    - a `ValueError` raised before the first delta means the request itself was refused (the
      API answers 400); any other exception means the backend failed (503);
    - `cache_salt` (optional kwarg): prefix-cache blocks are shared only between requests with
      the same salt. The API passes it only for tenants in a `prefix_cache_group` (the group's
      salt); without it the backend must salt with `tenant`, so tenants never share blocks.
      A backend that never serves such tenants may leave the kwarg out.
    - `fork_of` (optional kwarg, only for n > 1): the request is sample i >= 1 of the same
      prompt as request `fork_of` (started first): it may share that request's prompt KV
      blocks; a backend that cannot (or where the two land apart) runs it on its own.
* `abort(request_id)` (async) -> bool: cancel a request; its stream then ends with an
  "abort" delta (or simply ends).
* `tokenizer`: a `fairbatch.engine.tokenizer.Tokenizer` (encode, decode, apply_chat_template,
  eos_token_ids). The API tokenizes; the backend receives token ids only.
* `max_model_len`: prompt + completion tokens one request may hold.
* optional `update_tenant(name, weight, priority, tokens_per_minute, max_requests, change)`
  (sync or async): the tenant's complete new settings, called at app start-up for every
  configured tenant (`change` False) and on every admin change (`change` True: a backend that
  outlives the app may keep it). `tokens_per_minute` None = unlimited; `max_requests` None
  = the default bound. A backend shared by several ingresses enforces the limits over all of
  them and refuses a request over one by raising `policies.quota.Rejected` from its stream.
* optional `check_health()` (sync or async) -> bool: False or an exception makes /health 503.
* optional `check_lora(lora)` (sync or async): read and validate a `LoRARequest`'s adapter as
  the engines would serve it; a ValueError saying why not. Without it the backend serves no
  adapters. A request runs under an adapter when its `params.lora` names one.
* optional `remove_lora(lora)` (sync or async): the adapter is no longer served; the engines
  may drop it once the requests under it have ended.
* optional `lora_changed(name, lora, tenants)` (sync or async): an adapter loaded (`lora` None:
  unloaded) through the admin API, for a backend shared by several ingresses to keep.
* optional `stats()` (sync or async) -> dict: the engines' counters (`EngineCore.stats()`
  keys, summed over replicas), served to the admin at GET /admin/stats.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from fairbatch.engine.outputs import RequestDelta
from fairbatch.engine.sampling_params import SamplingParams


@runtime_checkable
class Backend(Protocol):
    tokenizer: Any
    max_model_len: int

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        tenant: str,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestDelta]: ...

    async def abort(self, request_id: str) -> bool: ...


class LocalBackend:
    """The protocol over one in-process `AsyncEngine` (or an `EngineCore`, wrapped)."""

    def __init__(self, engine: Any) -> None:
        from fairbatch.engine.async_engine import AsyncEngine

        self.engine: AsyncEngine = (
            engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
        )
        core = self.engine.engine
        if core.tokenizer is None:
            raise ValueError("the OpenAI API needs an engine with a tokenizer")
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.scheduler.max_model_len

    async def check_lora(self, lora: Any) -> None:
        await self.engine.call(self.engine.engine.check_lora, lora)

    async def remove_lora(self, lora: Any) -> None:
        await self.engine.call(self.engine.engine.remove_lora, lora.name)

    @classmethod
    def build(cls, model: str = "tiny", **engine_kwargs: Any) -> LocalBackend:
        """A backend over `build_engine(model, **engine_kwargs)` (loads torch), built on the
        engine thread that will step it (why: `AsyncEngine.build`)."""
        from fairbatch.engine.async_engine import AsyncEngine
        from fairbatch.engine.llm import build_engine

        return cls(AsyncEngine.build(functools.partial(build_engine, model, **engine_kwargs)))

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str,
        tenant: str,
        priority: int = 0,
        cache_salt: str | None = None,
        fork_of: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        stream = self.engine.generate(
            list(prompt_token_ids),
            params,
            request_id=request_id,
            tenant=tenant,
            priority=priority,
            cache_salt=cache_salt,  # None: the engine salts with the tenant
            fork_of=fork_of,  # a sibling sample: shares that request's prompt blocks
        )
        finished = False
        try:
            async for delta in stream:
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                # Abort here rather than rely on the inner stream being finalized by the garbage
                # collector: the blocks must be free when this generator's close returns.
                await asyncio.shield(self.engine.abort(request_id))
            await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def update_tenant(
        self,
        name: str,
        weight: float,
        priority: int,
        tokens_per_minute: float | None,
        max_requests: int | None,
        change: bool = False,
    ) -> None:
        # The ingress (this server's only one) enforces the limits at admission; the engine's
        # policy gets the share and the class (a second bucket in the scheduler would throttle
        # already admitted streams).
        policy = self.engine.engine.scheduler.policy
        await self.engine.call(policy.update_tenant, name, weight=weight, priority=priority)

    async def stats(self) -> dict:
        return await self.engine.call(self.engine.engine.stats)

    def check_health(self) -> bool:
        return getattr(self.engine, "_error", None) is None

    async def shutdown(self) -> None:
        await self.engine.shutdown()


def create_app(backend: Any, config: Any = None, **kwargs: Any):
    """See `fairbatch.deployments.api_server.create_app`."""
    from fairbatch.deployments.api.server import create_app as _create_app

    return _create_app(backend, config, **kwargs)


async def bind_backend(app: Any, backend: Any) -> None:
    """See `fairbatch.deployments.api_server.bind_backend`."""
    from fairbatch.deployments.api.server import bind_backend as _bind

    await _bind(app, backend)


__all__ = ["Backend", "LocalBackend", "bind_backend", "create_app"]
