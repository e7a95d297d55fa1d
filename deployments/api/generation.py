"""The generation routes: POST /v1/completions, /v1/chat/completions and /v1/responses.

Each validates its body, turns it into prompt ids and sampling parameters, admits and starts
every sample through the app's `_Api` (server.py), and answers whole or as a stream.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from fairbatch.deployments.api import schemas as S
from fairbatch.deployments.api.http import SSEResponse, read_json, validate
from fairbatch.deployments.api.reasoning import mode as reasoning_mode
from fairbatch.deployments.api.responses import (
    ResponseRun,
    collect_choices,
    complete_runs,
    stream_runs,
)
from fairbatch.deployments.api.responses_api import ResponseBuilder, ResponsesRequest
from fairbatch.deployments.api.schemas import ApiError, bad_request
from fairbatch.deployments.api.structured import (
    chat_plan,
    completion_grammar,
    with_grammar,
    with_plan,
)

if TYPE_CHECKING:
    from fairbatch.deployments.api.server import _Api
    from fairbatch.deployments.api.tenants import TenantState

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    api: _Api = request.app.state.api
    tenant = api.tenant(request)
    api.ready()
    body = validate(S.CompletionRequest, await read_json(request, api.limits.max_body_bytes))
    lora = api.check_model(body.model, tenant)
    body.check_unsupported()
    body.check_stream_options()
    stop = body.stop_list(api.limits.max_stop_sequences)
    vocab = api.tokenizer.vocab_size
    # echo with logprobs scores the prompt too; max_tokens 0 runs one token, then drops it
    prompt_top = body.logprobs if body.echo else None
    grammar = await completion_grammar(body)  # response_format
    jobs = []  # (text or None, ids, params), validated before anything is admitted
    for prompt in body.prompts(api.limits.max_prompts_per_request):
        ids = api.check_ids(prompt) if isinstance(prompt, list) else await api.encode(prompt)
        requested = 1 if body.max_tokens == 0 else body.max_tokens
        max_tokens = api.max_tokens(len(ids), requested, COMPLETION_DEFAULT_MAX_TOKENS)
        params = body.sampling_params(
            max_tokens,
            body.logprobs,
            stop,
            vocab=vocab,
            prompt_logprobs=prompt_top,
            deadlines=tenant.deadlines,
        )
        params = with_grammar(params, grammar)
        if lora is not None:
            params = dataclasses.replace(params, lora=lora)
        jobs.append((prompt if isinstance(prompt, str) else None, ids, params))
    started = await api.launch(
        request, tenant, "cmpl-", [(ids, p) for _, ids, p in jobs], model=body.model
    )
    runs = []
    for ticket, it, first, job, sample in started:
        text, ids, params = jobs[job]
        echo = None
        if body.echo:
            echo = (text if text is not None else api.tokenizer.decode(ids), ids)
        runs.append(ResponseRun(
            api, ticket, it, first, chat=False, top_n=body.logprobs,
            index=job * params.n + sample, echo=echo, discard_output=body.max_tokens == 0,
            model=body.model,
        ))  # fmt: skip
    return await _respond(request, runs, body)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    api: _Api = request.app.state.api
    tenant = api.tenant(request)
    api.ready()
    data = await read_json(request, api.limits.max_body_bytes)
    body = validate(S.ChatCompletionRequest, data)
    runs = await _chat_runs(api, request, tenant, body)
    return await _respond(request, runs, body)


@router.post("/v1/responses")
async def responses(request: Request) -> Any:
    api: _Api = request.app.state.api
    tenant = api.tenant(request)
    api.ready()
    data = await read_json(request, api.limits.max_body_bytes)
    body = validate(ResponsesRequest, data)
    try:
        chat = validate(S.ChatCompletionRequest, body.chat_body())
        (run,) = await _chat_runs(api, request, tenant, chat, prefix="resp_")  # the response's id
    except ApiError as e:  # named by this request's fields, not the chat request's
        e.param = body.param_of(e.param)
        raise
    reply = ResponseBuilder(body, run)
    if body.stream:
        return SSEResponse(reply.events(), run.close)
    (choice,) = await collect_choices(request, [run])
    return JSONResponse(reply.whole(choice))


async def _respond(request: Request, runs: list[ResponseRun], body: Any) -> Any:
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)

        async def close_all() -> None:
            for r in runs:
                await r.close()

        return SSEResponse(stream_runs(runs, usage), close_all)
    return await complete_runs(request, runs)


async def _chat_runs(
    api: _Api,
    request: Request,
    tenant: TenantState,
    body: S.ChatCompletionRequest,
    prefix: str = "chatcmpl-",
) -> list[ResponseRun]:
    """A validated chat body admitted and started: one run per sample, its request ids
    starting with `prefix`."""
    lora = api.check_model(body.model, tenant)
    body.check_unsupported()
    body.check_stream_options()
    messages = body.chat_messages()
    kwargs = S.template_kwargs(body.chat_template_kwargs)
    try:
        # `tools` as Hugging Face passes them (None without): templates that know tool use
        # render them into the prompt; `chat_template_kwargs` go with them
        text = api.tokenizer.apply_chat_template(messages, tools=body.tools, **kwargs)
    except Exception as e:  # the template's own checks (roles, order) raise ValueError
        msg = str(e) if isinstance(e, ValueError) else "the chat template cannot render these"
        raise bad_request(msg[:500], "messages") from None
    bos = api.tokenizer.bos_token
    ids = await api.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = api.max_tokens(len(ids), requested, api.limits.default_max_tokens)
    stop = body.stop_list(api.limits.max_stop_sequences)
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(
        max_tokens, top_n, stop, vocab=api.tokenizer.vocab_size, deadlines=tenant.deadlines
    )
    cfg = api.config
    reasoning = reasoning_mode(cfg.reasoning_parser, kwargs, text)
    plan = await chat_plan(body, cfg.tool_call_parser, reasoning)
    params = with_plan(params, plan)
    if lora is not None:
        params = dataclasses.replace(params, lora=lora)
    launched = await api.launch(request, tenant, prefix, [(ids, params)], model=body.model)
    return [
        ResponseRun(
            api,
            ticket,
            it,
            first,
            chat=True,
            top_n=top_n,
            output=plan.converter(),
            index=sample,
            model=body.model,
        )
        for ticket, it, first, _, sample in launched
    ]
