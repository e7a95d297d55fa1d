"""What a replica runs: its config (`ReplicaConfig`, checked where it is read) and the engine it
builds from it (`build_core`: a simulated runner, or a real model), paced like its GPU when
simulated (`pace_step`)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from fairbatch.engine.core import EngineCore
from fairbatch.policies import TenantSpec
from fairbatch.scheduler import SchedulerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ReplicaConfig:
    # a Hugging Face model directory, or "tiny" (the embedded model) or "sim" (the simulated
    # runner: tests and benchmarks); no default, a replica serves the model it is told
    engine: str
    num_gpu_blocks: int = 256
    num_cpu_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    policy: str = "priority"  # the local queue's order
    tenants: list[TenantSpec] = field(default_factory=list)
    policy_kwargs: dict = field(default_factory=dict)  # e.g. dlpm's quantum
    preemption_mode: str = "auto"
    # sim only: the modelled hardware, and real seconds slept per virtual second of step time
    # (0 = unpaced; 1 = as slow as the modelled GPU)
    sim_model: str = "llama3_8b"
    sim_gpu: str = "H100"
    sim_vocab: int = 1000
    time_scale: float = 0.0
    report_interval_s: float = 0.02
    heartbeat_s: float = 0.5
    device: str = "cpu"
    # CPU model: intra-op threads; 0 = this replica's share of its node's cores (`cpu_threads`)
    torch_threads: int = 0
    # the model's dtype: "auto" keeps the engine's choice (engine/loader.py's default_dtype:
    # bfloat16 on CUDA; on CPU the checkpoint's, bfloat16 where the CPU has a bf16 path)
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    # host memory for the prefix cache's second tier (kv/host_tier.py), beside the swap space;
    # None: the engine's default (off on CPU, on with a default size on CUDA)
    cpu_cache_gb: float | None = None
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    # LoRA adapters served at once (pool slots; 0: none) and the largest rank one may have
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        """Bad values fail here, where a config is read, not in a replica starting later."""
        SchedulerConfig(  # its own checks: seats, token budget, context, preemption mode
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            preemption_mode=self.preemption_mode,
        )
        at_least = {
            "num_gpu_blocks": 1,
            "num_cpu_blocks": 0,
            "block_size": 1,
            "torch_threads": 0,
            "max_loras": 0,
            "max_lora_rank": 1,
        }
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("report_interval_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.time_scale >= 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.cpu_cache_gb is not None and not self.cpu_cache_gb >= 0:
            raise ValueError(f"cpu_cache_gb must be >= 0, got {self.cpu_cache_gb}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        device = self.device
        if not (device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device)):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def build_core(cfg: ReplicaConfig) -> EngineCore:
    """The engine factory: a simulated runner ("sim") or the real model (anything else)."""
    if cfg.engine == "sim":
        from fairbatch.engine import gpu_profiles
        from fairbatch.engine.sim_runner import SimRunner
        from fairbatch.kv.manager import KVCacheManager
        from fairbatch.policies import make_policy
        from fairbatch.scheduler import Scheduler

        shape = getattr(gpu_profiles, cfg.sim_model)()
        runner = SimRunner(shape, cfg.sim_gpu, vocab_size=cfg.sim_vocab, block_size=cfg.block_size)
        sched_cfg = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            preemption_mode=cfg.preemption_mode,
            kv_bytes_per_token=shape.kv_bytes_per_token,
        )
        block_bytes = shape.kv_bytes_per_token * cfg.block_size
        tier = int((cfg.cpu_cache_gb or 0) * 2**30) // block_bytes  # (the modelled GPU's K/V)
        kv = KVCacheManager(
            cfg.num_gpu_blocks,
            cfg.block_size,
            cfg.num_cpu_blocks + tier,
            cfg.enable_prefix_caching,
            host_tier=tier > 0,
        )
        policy = make_policy(cfg.policy, cfg.tenants, **cfg.policy_kwargs)
        return EngineCore(Scheduler(sched_cfg, kv, policy), runner)
    import torch

    from fairbatch.engine.llm import build_engine

    if cfg.device == "cpu":  # ("auto" is resolved by the replica)
        torch.set_num_threads(cfg.torch_threads or cpu_threads())
    return build_engine(
        cfg.engine,
        device=cfg.device,
        block_size=cfg.block_size,
        num_gpu_blocks=cfg.num_gpu_blocks,
        num_cpu_blocks=cfg.num_cpu_blocks,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        preemption_mode=cfg.preemption_mode,
        policy=cfg.policy,
        tenants=cfg.tenants,
        policy_kwargs=cfg.policy_kwargs,
        dtype=None if cfg.dtype == "auto" else getattr(torch, cfg.dtype),
        enable_prefix_caching=cfg.enable_prefix_caching,
        cpu_cache_gb=cfg.cpu_cache_gb,
        enforce_eager=cfg.enforce_eager,
        max_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank,
    )


def cpu_threads() -> int:
    """A CPU replica's torch threads by default: the cores this process may use, times the
    replica's share of its node's GPUs (on a machine without CUDA these are the fake GPUs Ray
    is given, one per replica), so the replicas on a node split its cores. All the cores
    outside a Ray worker; one for a replica that holds no GPU (its neighbours are not known)."""
    import os

    import ray

    cores = len(os.sched_getaffinity(0))
    if not ray.is_initialized():
        return cores
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE:  # a driver: holds no resources
        return cores
    mine = ctx.get_assigned_resources().get("GPU", 0.0)
    node = next((n for n in ray.nodes() if n["NodeID"] == ctx.get_node_id()), None)
    total = node["Resources"].get("GPU", 0.0) if node else 0.0
    if not (mine > 0 and total > 0):
        return 1
    return max(1, int(cores * mine / total))


def pace_step(core: EngineCore, time_scale: float) -> None:
    """After a step of a simulated engine: sleep what the step would take on its GPU, scaled by
    `time_scale` (0: no pacing). Real engines have no modelled cost and are never paced."""
    if time_scale > 0:
        cost = getattr(core.runner, "last_cost", None)
        if cost is not None and cost.total_s > 0:
            time.sleep(cost.total_s * time_scale)
