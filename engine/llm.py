"""The offline API, as vLLM users know it: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fairbatch.engine.core import EngineCore
from fairbatch.engine.lora import LoRAPool, LoRARequest, attach_lora
from fairbatch.engine.memory import (
    check_host_kv_memory,
    default_cpu_cache_gb,
    host_memory_available,
    kv_cache_budget,
    max_useful_blocks,
    num_kv_blocks,
    profile_cuda_memory,
)
from fairbatch.engine.runner import ModelRunner
from fairbatch.engine.sampler import Sampler
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.kv.cache_engine import CacheEngine, KVLayout, num_blocks_for_budget
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Scheduler, SchedulerConfig
from fairbatch.scheduler.loras import LoRASlots


@dataclass
class Sample:
    """One of the n samples of a prompt (SamplingParams.n)."""

    index: int
    request_id: str  # the engine request that produced it
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[Any] | None = None


@dataclass
class RequestOutput:
    """One prompt's result. The fields describe sample 0; `samples` holds all n of them
    (sample 0 first: for n = 1 just that one)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated token ids
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[Any] | None = None
    # with SamplingParams(prompt_logprobs=k): None for the first prompt token, then one record
    # [(token, lp), (top1, lp), ...] per prompt token
    prompt_logprobs: list[Any] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    samples: list[Sample] = field(default_factory=list)


def load_model(model: str, device: torch.device, dtype, attn_backend):
    """(model, config, tokenizer, eos ids) for "tiny" or a Hugging Face model directory."""
    if model == "tiny":
        from fairbatch.engine.tiny import build_tiny

        m, config, tok = build_tiny(device, dtype, attn_backend)
        return m, config, tok, tuple(tok.eos_token_ids)
    from fairbatch.engine.loader import load_hf_model
    from fairbatch.engine.tokenizer import Tokenizer

    m, config, generation = load_hf_model(model, device, dtype, attn_backend)
    tok = Tokenizer.from_dir(model) if (Path(model) / "tokenizer.json").is_file() else None
    eos = tuple(generation.get("eos_token_ids") or ())
    if tok is not None:
        eos = tuple(dict.fromkeys([*eos, *tok.eos_token_ids]))
    return m, config, tok, eos


def build_engine(
    model: str = "tiny",
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    attn_backend: str | None = None,
    block_size: int = 16,
    num_gpu_blocks: int | None = None,
    num_cpu_blocks: int | None = None,
    kv_cache_bytes: int = 256 << 20,
    swap_space_bytes: int = 256 << 20,
    cpu_cache_gb: float | None = None,
    num_cpu_cache_blocks: int | None = None,
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    preemption_mode: str = "auto",
    policy: str = "fcfs",
    tenants: list[TenantSpec] | None = None,
    policy_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    enforce_eager: bool = False,
    max_loras: int = 0,
    max_lora_rank: int = 16,
) -> EngineCore:
    """An EngineCore on the real model. KV sizing: explicit block counts win; otherwise
    `kv_cache_bytes` on CPU, or on CUDA `gpu_memory_utilization` of the device less the
    weights, the peak activations of a profiled dummy step, the decode CUDA graphs' measured
    memory and what other processes hold (engine/memory.py); either way at most the blocks
    `max_num_seqs` sequences of `max_model_len` tokens fill. Host memory holds the swap space
    and the prefix cache's host tier (`cpu_cache_gb`, or `num_cpu_cache_blocks`; default: off
    on CPU, `default_cpu_cache_gb` on CUDA) in one pool (kv/host_tier.py); more than the machine
    has free is refused here. On CUDA decode steps replay CUDA
    graphs where the attention backend allows it, unless `enforce_eager`. Settings the
    backend cannot run fail here.
    `max_loras` > 0 serves LoRA adapters (of rank <= `max_lora_rank`) in that many slots,
    eagerly (the batched delta groups tokens on the host: no CUDA graphs).
    `policy_kwargs` go to the policy (e.g. `{"order_within_tenant": "edf"}`, dlpm's
    `quantum`); a policy they cannot build fails before the model loads."""
    if block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
    try:
        queue_policy = make_policy(policy, tenants or (), **(policy_kwargs or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"policy / policy_kwargs: {e}") from None
    dev = torch.device(device)
    m, config, tok, eos = load_model(model, dev, dtype, attn_backend)
    if dev.type == "cpu":
        m.pack_for_cpu()
    param_dtype = next(m.parameters()).dtype
    backend = m.attn_backend(dev, param_dtype)  # raises if it cannot run this model here
    try:
        backend.check_block_size(block_size)
    except ValueError as e:
        raise ValueError(
            f"{e} (attention backend {backend.name!r}; pick another block_size)"
        ) from e
    layout = KVLayout(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        block_size,
        param_dtype,
        head_major=backend.head_major,
    )
    max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    # A mixture-of-experts layer sizes its expert groups from the data: no CUDA graph for it.
    use_graphs = (
        dev.type == "cuda"
        and backend.supports_cuda_graphs
        and not enforce_eager
        and not config.num_experts
        and not max_loras  # the LoRA delta reads its group sizes on the host
    )
    if num_gpu_blocks is None:
        if dev.type == "cuda":
            profile = profile_cuda_memory(
                m,
                layout,
                dev,
                max_num_batched_tokens,
                max_num_seqs,
                max_len,
                Sampler(generator=torch.Generator(device=dev).manual_seed(0)),
                cuda_graphs=use_graphs,
            )
            budget = kv_cache_budget(profile, gpu_memory_utilization)
        else:
            budget = kv_cache_bytes
        cap = max_useful_blocks(max_len, max_num_seqs, block_size)
        num_gpu_blocks = num_kv_blocks(budget, layout.bytes_per_block, cap)
    if num_gpu_blocks < 1:
        raise ValueError("no memory left for the KV cache; lower the model size or raise limits")
    if num_cpu_blocks is None:
        num_cpu_blocks = num_blocks_for_budget(layout, swap_space_bytes)
    available = host_memory_available()
    if num_cpu_cache_blocks is None:
        if cpu_cache_gb is None:
            cpu_cache_gb = default_cpu_cache_gb(dev.type == "cuda", available)
        if cpu_cache_gb < 0:
            raise ValueError(f"cpu_cache_gb must be >= 0, got {cpu_cache_gb}")
        num_cpu_cache_blocks = num_blocks_for_budget(layout, int(cpu_cache_gb * 2**30))
    bpb = layout.bytes_per_block
    check_host_kv_memory(num_cpu_cache_blocks * bpb, num_cpu_blocks * bpb, available)
    num_host_blocks = num_cpu_blocks + num_cpu_cache_blocks
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_len,
        preemption_mode=preemption_mode,
        kv_bytes_per_token=layout.bytes_per_token,
    )
    kv = KVCacheManager(
        num_gpu_blocks,
        block_size,
        num_host_blocks,
        enable_prefix_caching,
        host_tier=num_cpu_cache_blocks > 0,
    )
    # (tenants' kv_share reach the KV manager through the policy: Scheduler.__init__)
    scheduler = Scheduler(sched_cfg, kv, queue_policy)
    cache = CacheEngine(layout, num_gpu_blocks, num_host_blocks, dev, pad_block=use_graphs)
    gen = torch.Generator(device=dev).manual_seed(seed)
    runner = ModelRunner(m, cache, Sampler(generator=gen))
    if max_loras > 0:
        pool = LoRAPool(config, max_loras, max_lora_rank, dtype=param_dtype, device=dev)
        runner.lora = attach_lora(m, pool)
        scheduler.loras = LoRASlots(pool)
    if use_graphs:
        runner.capture_decode_graphs(max_num_seqs, max_len)
    rule = m.cache_salt_rule(config)  # the family's; the cluster's client hashes with it too
    return EngineCore(scheduler, runner, tok, eos, vocab_size=config.vocab_size, salt_rule=rule)


class LLM:
    """Offline batch generation. Keyword arguments are those of `build_engine`."""

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        self.engine = build_engine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora`: one adapter
        for all prompts, or one per prompt (None: the base model); needs `max_loras` > 0."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if isinstance(lora, list):
            if len(lora) != len(prompts):
                raise ValueError(f"{len(lora)} LoRA requests for {len(prompts)} prompts")
            loras = lora
        else:
            loras = [lora] * len(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            plist = params
        else:
            plist = [params or SamplingParams()] * len(prompts)
        engine = self.engine
        outputs: dict[str, RequestOutput] = {}  # one per engine request (sample)
        groups: list[list[str]] = []  # per prompt: its samples' request ids, sample 0 first
        for prompt, p, adapter in zip(prompts, plist, loras):
            group: list[str] = []
            groups.append(group)
            try:
                for i in range(p.n):  # samples 1.. fork sample 0's prompt blocks
                    req = engine.add_request(
                        prompt,
                        p.for_sample(i),
                        fork_of=group[0] if group else None,
                        lora=adapter,
                    )
                    group.append(req.request_id)
                    outputs[req.request_id] = RequestOutput(
                        req.request_id,
                        prompt if isinstance(prompt, str) else None,
                        list(req.prompt_token_ids),
                        [],
                        "",
                        None,
                        [] if p.logprobs is not None else None,
                    )
            except Exception:
                for rid in outputs:  # all or nothing: a bad prompt leaves no work behind
                    engine.abort(rid)
                engine.scheduler.schedule()  # drain the abort notices
                raise
        bar = None
        if use_tqdm and len(outputs) >= 8:
            from tqdm import tqdm

            bar = tqdm(total=len(outputs), desc="generate", unit="req")
        try:
            while engine.has_unfinished():
                for d in engine.step():
                    o = outputs[d.request_id]
                    o.token_ids.extend(d.token_ids)
                    o.text += d.text
                    if d.logprobs and o.logprobs is not None:
                        o.logprobs.extend(d.logprobs)
                    if d.prompt_logprobs is not None:
                        o.prompt_logprobs = d.prompt_logprobs
                    if d.num_cached_tokens is not None:
                        o.num_cached_tokens = d.num_cached_tokens
                    if d.finished:
                        o.finish_reason = d.finish_reason
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        results = []
        for group in groups:
            result = outputs[group[0]]
            for i, rid in enumerate(group):
                o = outputs[rid]
                result.samples.append(
                    Sample(i, rid, o.token_ids, o.text, o.finish_reason, o.logprobs)
                )
            results.append(result)
        return results
