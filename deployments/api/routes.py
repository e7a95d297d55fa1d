"""The routes around generation: GET /health, GET /v1/models[/{model}] (the base model and
the LoRA adapters the caller may use), the caller's own requests (GET|DELETE
/v1/requests/{id}), and the admin routes (GET /admin/tenants, GET /admin/stats, PATCH
/admin/tenants/{name}, GET /admin/usage, GET|POST /admin/loras, DELETE /admin/loras/{name}).
Each reads the app's `_Api` (server.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from fairbatch.deployments.api import schemas as S
from fairbatch.deployments.api.http import maybe_await, read_json, validate
from fairbatch.deployments.api.schemas import ApiError, bad_request
from fairbatch.deployments.usage import parse_period

if TYPE_CHECKING:
    from fairbatch.deployments.api.server import _Api
    from fairbatch.deployments.api.tenants import Admission

log = logging.getLogger("fairbatch.api")
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    api: _Api = request.app.state.api
    check = getattr(api.backend, "check_health", None)
    ok = api.backend is not None
    if check is not None:
        try:
            ok = bool(await maybe_await(check()))
        except Exception:
            ok = False
    if not ok:
        return JSONResponse({"status": "unhealthy"}, status_code=503)
    return JSONResponse({"status": "ok"})


def _card(api: _Api, name: str) -> dict:
    """A model's card: the base model's, or an adapter's (whose `parent` is the base)."""
    card = S.model_card(name, api.created, api.max_model_len)
    if name != api.model_name:
        card.update(root=name, parent=api.model_name)
    return card


@router.get("/v1/models")
async def models(request: Request) -> dict:
    api: _Api = request.app.state.api
    tenant = api.tenant(request)
    api.ready()
    names = [api.model_name, *(e.name for e in api.loras.visible(tenant.name))]
    return {"object": "list", "data": [_card(api, name) for name in names]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict:
    api: _Api = request.app.state.api
    tenant = api.tenant(request)
    api.ready()
    api.check_model(model, tenant)
    return _card(api, model)


# ---- the caller's own requests -----------------------------------------------------------------


def _own(api: _Api, request: Request, request_id: str) -> Admission:
    ticket = api.registry.lookup(api.tenant(request), request_id)
    if ticket is None:  # also when another tenant owns it: ids cannot be probed
        raise ApiError(404, f"no request {request_id!r} in flight", code="request_not_found")
    return ticket


@router.get("/v1/requests/{request_id}")
async def get_request(request_id: str, request: Request) -> dict:
    api: _Api = request.app.state.api
    t = _own(api, request, request_id)
    return {
        "id": t.request_id,
        "object": "request",
        "created": t.created,
        "model": api.model_name,
        "status": "cancelling" if t.cancelled else "running",
        "usage": S.usage(t.prompt_tokens, t.completion_tokens),
    }


@router.delete("/v1/requests/{request_id}")
async def cancel_request(request_id: str, request: Request) -> dict:
    api: _Api = request.app.state.api
    t = _own(api, request, request_id)
    t.cancelled = True
    await api.backend.abort(t.request_id)
    log.info("cancel request_id=%s tenant=%s", t.request_id, t.tenant.name)
    return {"id": t.request_id, "object": "request", "cancelled": True}


# ---- admin -------------------------------------------------------------------------------------


@router.get("/admin/tenants")
async def list_tenants(request: Request) -> dict:
    api: _Api = request.app.state.api
    api.require_admin(request)
    reg = api.registry
    return {
        "object": "list",
        "data": [t.public() for t in reg.tenants.values()],
        "in_flight": reg.total_in_flight,
        "rejected": reg.rejected_total,
    }


@router.get("/admin/stats")
async def stats(request: Request) -> dict:
    """The engines' counters (preemptions, swaps, prefix hits, occupancy) and the API's
    own (rejections, in flight): what a benchmark reads before and after a run."""
    api: _Api = request.app.state.api
    api.require_admin(request)
    engine: dict = {}
    get = getattr(api.backend, "stats", None)
    if get is not None:
        try:
            engine = await maybe_await(get())
        except Exception:
            log.error("backend stats failed", exc_info=True)
            raise ApiError(503, "the backend did not answer", type="server_error") from None
    reg = api.registry
    return {
        "object": "stats",
        "engine": engine,
        "rejected": reg.rejected_total,
        "in_flight": reg.total_in_flight,
    }


@router.get("/admin/usage")
async def usage(
    request: Request, tenant: str | None = None, since: str | None = None, until: str | None = None
) -> dict:
    """Per-tenant sums of the usage records of requests that ended in [since, until) (Unix
    seconds or ISO 8601; either may be left out), of one `tenant` when given."""
    api: _Api = request.app.state.api
    api.require_admin(request)
    try:
        lo, hi = parse_period(since, until)
    except ValueError as e:
        raise bad_request(str(e), "since" if str(e).startswith("since") else "until") from None
    api.ready()
    try:
        summary = await api.usage_summary(tenant, lo, hi)
    except ApiError:
        raise
    except Exception:
        log.error("usage summary failed", exc_info=True)
        raise ApiError(503, "the usage log could not be read", type="server_error") from None
    return {"object": "usage", **summary}


@router.patch("/admin/tenants/{name}")
async def patch_tenant(name: str, request: Request) -> dict:
    api: _Api = request.app.state.api
    api.require_admin(request)
    data = await read_json(request, api.limits.max_body_bytes)
    patch = validate(S.TenantPatch, data)
    reg = api.registry
    if name not in reg.tenants:
        raise ApiError(404, f"unknown tenant {name!r}", param="name", code="tenant_not_found")
    saved = reg.snapshot(name)
    state = reg.update(
        name,
        weight=patch.weight,
        priority=patch.priority,
        tokens_per_minute=patch.tokens_per_minute,
        clear_quota="tokens_per_minute" in patch.model_fields_set
        and patch.tokens_per_minute is None,
        max_requests=patch.max_requests,
        clear_max_requests="max_requests" in patch.model_fields_set and patch.max_requests is None,
    )
    try:
        await api.push_tenant(state, change=True)
    except Exception:
        log.error("backend refused the update of tenant %s", name, exc_info=True)
        restored = reg.restore(saved)
        try:  # a backend that took part of the update (some replicas) gets the old one back
            await api.push_tenant(restored, change=True)
        except Exception:
            log.error("could not push the restored tenant %s", name, exc_info=True)
        raise ApiError(502, "the backend refused the tenant update", type="server_error") from None
    log.info("admin updated tenant %s", name)
    return state.public()


@router.get("/admin/loras")
async def list_loras(request: Request) -> dict:
    api: _Api = request.app.state.api
    api.require_admin(request)
    return {"object": "list", "data": [e.public() for e in api.loras.entries.values()]}


@router.post("/admin/loras")
async def load_lora(request: Request) -> dict:
    """Serve a LoRA adapter from now on, once the backend has read and validated it (a 400
    with the reason, and nothing changed, when it cannot)."""
    api: _Api = request.app.state.api
    api.require_admin(request)
    api.ready()
    body = validate(S.LoRALoad, await read_json(request, api.limits.max_body_bytes))
    return await api.load_lora(body.name, body.path, body.tenants)


@router.delete("/admin/loras/{name}")
async def unload_lora(name: str, request: Request) -> dict:
    """Stop serving an adapter: new requests for it get 404 at once; those already accepted
    run to their end."""
    api: _Api = request.app.state.api
    api.require_admin(request)
    return await api.unload_lora(name)
