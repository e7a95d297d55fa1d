"""What a GPU can do and what a model costs: the two inputs of the simulated runner's roofline.

Pure Python (no torch): the simulated runner runs inside lightweight Ray actors and CPU tests.

`GPUProfile` holds vendor datasheet peaks; the runner applies an achieved-fraction (efficiency) on
top, so the numbers here stay exactly what the datasheets print. `ModelShape` is the arithmetic of
a Llama-family decoder (GQA attention, SwiGLU MLP, RMSNorm, no biases): parameter count, weight
bytes, K/V bytes per token and FLOPs per token.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class GPUProfile:
    name: str
    hbm_bandwidth: float  # bytes/s, device memory (HBM) peak
    peak_flops: float  # FLOP/s, dense bf16 tensor-core peak (datasheets print 2x "with sparsity")
    memory_bytes: int  # device memory capacity
    host_link_bandwidth: float  # bytes/s per direction, effective, host<->device (swap copies)

    def __post_init__(self) -> None:
        for field_name in ("hbm_bandwidth", "peak_flops", "memory_bytes", "host_link_bandwidth"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{field_name} must be > 0, got {getattr(self, field_name)}")


# Capacities: NVIDIA's "80GB"/"141GB" HBM sizes are binary (an 80GB A100 reports 81,920 MiB in
# nvidia-smi), so they are written in GiB here. Host links: the datasheets give PCIe as a
# bidirectional total (Gen4 x16 "64GB/s", Gen5 x16 "128GB/s"), i.e. 32 / 64 GB/s per direction;
# pinned-memory cudaMemcpyAsync reaches roughly 80% of that, hence ~25e9 and ~50e9.

# NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column
# (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
#  nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): "GPU Memory Bandwidth 2,039GB/s",
# "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*" (* with sparsity), "GPU Memory 80GB HBM2e",
# "PCIe Gen4: 64GB/s".
A100_80GB = GPUProfile(
    name="A100-80GB",
    hbm_bandwidth=2.039e12,
    peak_flops=312e12,
    memory_bytes=80 * GiB,
    host_link_bandwidth=25e9,
)

# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column
# (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet): "GPU memory
# bandwidth 3.35TB/s", "BF16 Tensor Core 1,979 teraFLOPS*" (* with sparsity: 989 dense),
# "GPU memory 80GB", "PCIe Gen5: 128GB/s".
H100_SXM = GPUProfile(
    name="H100-SXM",
    hbm_bandwidth=3.35e12,
    peak_flops=989e12,
    memory_bytes=80 * GiB,
    host_link_bandwidth=50e9,
)

# NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (nvidia.com/en-us/data-center/h200):
# "GPU Memory 141GB", "GPU Memory Bandwidth 4.8TB/s", "BFLOAT16 Tensor Core 1,979 TFLOPS*"
# (* with sparsity: 989 dense; the same GH100 compute die as H100), "PCIe Gen5: 128GB/s".
H200 = GPUProfile(
    name="H200",
    hbm_bandwidth=4.8e12,
    peak_flops=989e12,
    memory_bytes=141 * GiB,
    host_link_bandwidth=50e9,
)

PROFILES: dict[str, GPUProfile] = {p.name.lower(): p for p in (A100_80GB, H100_SXM, H200)}
# Short names people actually type; the SXM parts are the ones LLM serving runs on.
ALIASES: dict[str, str] = {"a100": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200"}


def get_profile(name: str) -> GPUProfile:
    """The profile called `name` (case-insensitive; "A100", "H100" and "H200" work)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    profile = PROFILES.get(key)
    if profile is None:
        valid = sorted({p.name for p in PROFILES.values()} | {a.upper() for a in ALIASES})
        raise ValueError(f"unknown GPU profile {name!r}; valid names: {', '.join(valid)}")
    return profile


def profile_for_device(device_name: str) -> GPUProfile | None:
    """The profile of a device as CUDA names it (`torch.cuda.get_device_name()`, e.g.
    "NVIDIA H100 80GB HBM3"), or None for a GPU without one. PCIe variants of these parts
    have less bandwidth than the SXM figures here; a check against them is optimistic."""
    name = device_name.upper()
    for key, profile in (("H200", H200), ("H100", H100_SXM), ("A100", A100_80GB)):
        if key in name:
            return profile
    return None


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's dimensions; everything the roofline needs about the model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2  # bf16 weights and K/V cache
    tie_word_embeddings: bool = False  # lm_head shares the embedding table (no extra weights)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_config(cls, cfg: object, dtype_bytes: int = 2) -> ModelShape:
        """From `fairbatch.engine.config.ModelConfig` (duck-typed: HF attribute names)."""
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            dtype_bytes=dtype_bytes,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )

    @property
    def _layer_matmul_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        o = self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return qkv + o + mlp

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul for every token: all layers' linears + lm_head.

        The input embedding is a row gather, not a matmul; a tied lm_head still multiplies.
        """
        return self.num_layers * self._layer_matmul_params + self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        norms = (2 * self.num_layers + 1) * h  # two RMSNorms per layer + the final one
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * self._layer_matmul_params + norms + embed + lm_head

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head (GQA stores num_kv_heads, not num_heads).
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query token, key token) pair over all layers: q.k and p.v are each
        num_heads * head_dim multiply-adds (2 FLOPs) per layer -> 4 * num_heads * head_dim * L."""
        return 4 * self.num_heads * self.head_dim * self.num_layers

    def flops_per_token(self, context_len: int = 0) -> int:
        """Forward FLOPs of one token that attends to `context_len` keys (itself included):
        2 * matmul_params (one multiply-add per weight) + the attention-score term.

        Ignored as small next to these: norms, RoPE, SiLU, softmax (O(hidden) or O(context) per
        token, no hidden^2 factor).
        """
        return 2 * self.matmul_params + self.attention_flops_per_pair * context_len


def llama3_8b() -> ModelShape:
    # meta-llama/Meta-Llama-3-8B config.json: 8.03e9 parameters.
    return ModelShape(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    )


def llama3_70b() -> ModelShape:
    # meta-llama/Meta-Llama-3-70B config.json: 70.6e9 parameters, 141 GB in bf16 - more than
    # one GPU holds; serving it needs tensor parallelism, which the simulator does not model.
    return ModelShape(
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
    )


def tiny() -> ModelShape:
    # The shape of the tiny reference checkpoints in tests/engine/conftest.py.
    return ModelShape(
        num_layers=3,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
    )
