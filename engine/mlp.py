"""The feed-forward blocks of a decoder layer: a dense gated MLP (SwiGLU; GELU-tanh for
Gemma), and Qwen3-MoE's sparse mixture of experts built from such MLPs.

Both take the step's flattened rows `[T, hidden]`; every row is computed on its own, so the
layer may feed them in any slices (DecoderLayer's CPU chunks).

The MoE block follows transformers' Qwen3MoeSparseMoeBlock numerically: router logits in the
activation dtype, softmax over all experts in float32, top-k, optional renormalisation in
float32, routing weights cast back to the activation dtype, and each token's expert outputs
summed into a zero tensor in ascending expert order (the order of HF's expert loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fairbatch.engine.config import ModelConfig


class MLP(nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))`, act SiLU (SwiGLU) or, for Gemma,
    `gelu_pytorch_tanh` (transformers' GELUTanh: torch's tanh-approximated GELU)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise NotImplementedError(f"activation {act!r} is not implemented")
        self.gelu = act == "gelu_pytorch_tanh"
        self.intermediate_size = intermediate_size
        # gate and up fused into one matmul: rows [0, I) gate, [I, 2I) up.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)  # [T, hidden]


class SparseMoeBlock(nn.Module):
    """Top-k routing over `num_experts` SwiGLU experts (Qwen3-MoE).

    Each token runs through its chosen experts only: the (token, choice) pairs are grouped by
    expert, each expert runs once on its group's rows, and the weighted outputs are added back
    by token. The experts are plain `MLP`s, so `pack_linears` packs them (and the router) for
    the CPU like any other linear. Group sizes are read on the host (one sync per layer), so
    this block cannot run inside a CUDA graph; a fused grouped-GEMM kernel would lift that.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights `[T, k]` (activation dtype) and expert indices `[T, k]` (int64)
        of rows `x [T, hidden]`, as transformers' Qwen3MoeTopKRouter computes them."""
        logits = self.gate(x)  # [T, E] in the activation dtype, as HF's
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts  # back to the activation dtype, as HF casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a mixture-of-experts layer cannot be captured in a CUDA graph (its expert "
                "groups have data-dependent sizes); the engine runs such models eagerly"
            )
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # Sort the T * k (token, choice) pairs by expert: each expert's rows become one run.
        chosen = experts.flatten()
        order = chosen.argsort(stable=True)
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order, None]
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows = tokens[start : start + n]
                # The rows are distinct (top-k picks an expert at most once per token), so an
                # indexed add is exact: the scatter-add without index_add_, whose CPU kernel is
                # far slower on small row counts.
                out[rows] += expert(x[rows]) * pair_weights[start : start + n]
            start += n
        return out  # [T, hidden]
