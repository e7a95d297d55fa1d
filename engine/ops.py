"""CPU fast paths for the model's matmuls: oneDNN with weights prepacked once.

On CPU, `F.linear` in float32 runs MKL's sgemm, which on non-Intel x86 CPUs keeps to its AVX2
code and multiplies at about half the speed oneDNN reaches with AVX-512 on the same core; in
bfloat16 it already goes through oneDNN, but reorders the weight into oneDNN's blocked layout on
every call. `PackedLinear` stores the weight reordered once (`mkldnn._reorder_linear_weight`,
tuned for decode-sized batches, good for prefill-sized ones too) and calls oneDNN's linear on
it: the same values, summed in a different order (float32 results differ from sgemm's by
rounding only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows the packed layout is tuned for: a decode step of a typical batch (vLLM's CPU backend
# packs for the same).
PACK_BATCH_HINT = 32


def onednn_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this torch build runs oneDNN linears for tensors of `dtype` on `device` (for
    bfloat16: on a CPU oneDNN has a bfloat16 path for, AVX-512 or AVX-NE-CONVERT; elsewhere
    bfloat16 linears stay with torch's own kernels)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return _bf16_supported()
    return dtype == torch.float32


def _bf16_supported() -> bool:
    global _BF16
    if _BF16 is None:
        _BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _BF16


_BF16: bool | None = None


class PackedLinear(nn.Module):
    """An `nn.Linear` for CPU inference whose weight lives in oneDNN's blocked layout.

    The packed weight is an opaque tensor (a buffer, not a parameter): this module cannot be
    trained, moved to another device or saved; build it from a loaded `nn.Linear`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT),
            persistent=False,
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` without bias, through oneDNN where it runs (a plain weight: no
    packed copy, for a weight that is also an embedding table)."""
    if onednn_usable(x.device, x.dtype) and weight.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (on the CPU, in a dtype oneDNN runs) by a
    `PackedLinear`; returns how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and onednn_usable(
                child.weight.device, child.weight.dtype
            ):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
