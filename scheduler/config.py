"""Scheduler configuration: plain data, no disk access, no model needed to build one."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # most requests running (holding GPU blocks) at once
    max_num_batched_tokens: int = 2048  # token budget of one step, prefill chunks + decodes
    max_model_len: int = 4096  # context limit: prompt + generated tokens
    enable_chunked_prefill: bool = True  # a prompt may be split across steps
    preemption_mode: str = "auto"  # "auto" (cost model), "swap" or "recompute"
    # A waiting request of strictly higher priority preempts a running one when seats or blocks
    # are short. None = as the policy declares (`Policy.preempts_lower_classes`, priority only).
    priority_preemption: bool | None = None
    # Cost model for "auto": swap moves 2x the victim's K/V bytes (out and back in) over the
    # host link; recompute re-runs its computed tokens through prefill.
    kv_bytes_per_token: int = 2 * 4 * 4 * 64 * 4  # 2 (K,V) x layers x kv heads x head dim x dtype
    swap_bandwidth: float = 16e9  # bytes/s host<->device (PCIe 4.0 x16 effective)
    prefill_tokens_per_s: float = 20_000.0  # measured or estimated prefill throughput

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
