"""A model runner with no model: FakeRunner's tokens, a roofline cost model's clock.

Drop-in for the real runner (`execute(SchedulerOutput) -> RunnerOutput`) so cluster tests and
benchmarks can drive many replicas and thousands of requests on a few CPU cores. Pure Python, no
torch: it runs inside lightweight Ray actors.

Tokens: exactly FakeRunner's rule. A scheduled request samples iff its chunk reaches the end of its
known tokens (num_computed_tokens + n == len(all_token_ids)), and the token is
`next_token(all_token_ids, vocab_size)`, a function of the history only - so a request that is
chunked, preempted, swapped or moved yields the same tokens, and the clock never changes them.

Time: each step advances `clock` (virtual seconds) by a roofline estimate. With eff the achieved
fraction of peak (`efficiency`), bs the block size, and per scheduled request r computing n_r new
tokens after c_r already cached ones:

    N         = sum_r n_r                                   tokens in the batch
    bytes     = weight_bytes                                every weight streamed once per step
              + sum_r (c_r + n_r) * kv_bytes_per_token      K/V read by attention
              + N * kv_bytes_per_token                      K/V of the new tokens written
    flops     = N * 2 * matmul_params                       linears + lm_head (ModelShape)
              + 4 * num_heads * head_dim * L * sum_r (n_r * c_r + n_r * (n_r + 1) / 2)
                  (q.k and p.v for each causal (query, key) pair: query i of the chunk sees
                   c_r + i keys; FlashAttention skips the masked tiles, so the count is causal)
    compute_s = step_overhead_s + max(bytes / (hbm_bw * eff), flops / (peak_flops * eff))
    swap_s    = (len(swap_in) + len(swap_out) + len(kv_store) + len(kv_load))
                * bs * kv_bytes_per_token / host_link_bw
    step time = max(compute_s, swap_s)          (0 for an empty output: nothing is launched)

Why max and not a sum for swaps: the runner issues swap copies on their own CUDA stream with a
per-layer event, so layer l of the forward waits only for layer l's blocks and the copies
pipeline with compute (docs/ARCHITECTURE.md, "The step"). The one-layer fill latency (swap_s / L) is
ignored. Swap-in and swap-out are summed although PCIe is full duplex: conservative, and the
scheduler rarely does both in one step (it admits nothing in a step that preempted).

Deliberately left out, all small next to the terms kept: activation traffic, norms/RoPE/softmax
FLOPs, the embedding table counted as streamed in full (~6% of Llama-3-8B's weight bytes) and
the lm_head counted for every token rather than only for sampled ones (~7% of a prefill token's
FLOPs). The `efficiency` factor absorbs kernel-level losses; calibrate it against the real runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairbatch.engine.gpu_profiles import GPUProfile, ModelShape, get_profile
from fairbatch.scheduler.fake_runner import next_token
from fairbatch.scheduler.output import RunnerOutput, SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's roofline terms, for tests and benchmarks that want to see the bound."""

    num_tokens: int  # tokens computed this step (N)
    hbm_bytes: int  # device-memory traffic of the forward (0 when nothing is scheduled)
    flops: int  # forward FLOPs
    memory_s: float  # hbm_bytes / (hbm_bandwidth * efficiency)
    math_s: float  # flops / (peak_flops * efficiency)
    swap_s: float  # host<->device block copies, on their own stream
    total_s: float  # what the clock advances by

    @property
    def bound(self) -> str:
        """What sets the step time: "memory", "compute", "swap", or "idle" (empty step)."""
        if self.total_s == 0.0:
            return "idle"
        if self.swap_s >= self.total_s:
            return "swap"
        return "memory" if self.memory_s >= self.math_s else "compute"


class SimRunner:
    def __init__(
        self,
        shape: ModelShape,
        gpu: GPUProfile | str = "H100",
        vocab_size: int | None = None,
        efficiency: float = 0.7,
        step_overhead_s: float = 2e-4,
        block_size: int = 16,
    ) -> None:
        if not 0.0 < efficiency <= 1.0:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        if step_overhead_s < 0.0:
            raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.shape = shape
        self.gpu = get_profile(gpu) if isinstance(gpu, str) else gpu
        # Tokens come from next_token(history, vocab_size); a caller comparing against a
        # FakeRunner passes the FakeRunner's vocab here.
        self.vocab_size = shape.vocab_size if vocab_size is None else vocab_size
        self.efficiency = efficiency
        self.step_overhead_s = step_overhead_s
        self.block_size = block_size
        # Per-step constants, computed once: step_cost runs every step of every replica.
        self._weight_bytes = shape.weight_bytes
        self._kv_bytes = shape.kv_bytes_per_token
        self._linear_flops = shape.flops_per_token(0)
        self._pair_flops = shape.attention_flops_per_pair
        self._mem_rate = self.gpu.hbm_bandwidth * efficiency
        self._math_rate = self.gpu.peak_flops * efficiency
        self._swap_block_bytes = block_size * self._kv_bytes
        self.clock = 0.0  # virtual seconds since construction
        self.busy_time = 0.0  # part of `clock` spent in steps (the rest is idle_until)
        self.num_steps = 0
        self.tokens_computed = 0
        self.swap_in_blocks = 0  # same counters as FakeRunner, so either can be swapped in
        self.swap_out_blocks = 0
        self.last_cost: StepCost | None = None

    # ---- the cost model ---------------------------------------------------------------------

    def step_cost(self, out: SchedulerOutput) -> StepCost:
        """The roofline terms of executing `out` (pure: reads `out`, changes nothing)."""
        num_scheduled = out.num_scheduled_tokens
        num_tokens = 0
        kv_read_tokens = 0  # sum of c + n: keys each request's attention reads
        causal_pairs = 0  # sum of n*c + n(n+1)/2: (query, key) pairs under the causal mask
        for req in out.scheduled:
            n = num_scheduled[req.request_id]
            c = req.num_computed_tokens
            num_tokens += n
            kv_read_tokens += c + n
            causal_pairs += n * c + n * (n + 1) // 2
        if num_tokens:
            hbm_bytes = self._weight_bytes + (kv_read_tokens + num_tokens) * self._kv_bytes
        else:
            hbm_bytes = 0  # a swap-only step runs no forward
        flops = num_tokens * self._linear_flops + causal_pairs * self._pair_flops
        memory_s = hbm_bytes / self._mem_rate
        math_s = flops / self._math_rate
        num_swap_blocks = len(out.swap_in) + len(out.swap_out) + len(out.kv_store)
        num_swap_blocks += len(out.kv_load)
        swap_s = num_swap_blocks * self._swap_block_bytes / self.gpu.host_link_bandwidth
        if out.is_empty:
            total_s = 0.0
        else:
            total_s = max(self.step_overhead_s + max(memory_s, math_s), swap_s)
        return StepCost(num_tokens, hbm_bytes, flops, memory_s, math_s, swap_s, total_s)

    def step_time(self, out: SchedulerOutput) -> float:
        """Virtual seconds that executing `out` takes (pure)."""
        return self.step_cost(out).total_s

    # ---- the runner contract ----------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        cost = self.step_cost(out)
        self.last_cost = cost
        self.num_steps += 1
        self.clock += cost.total_s
        self.busy_time += cost.total_s
        self.tokens_computed += cost.num_tokens
        self.swap_in_blocks += len(out.swap_in)
        self.swap_out_blocks += len(out.swap_out)
        sampled: dict[str, int] = {}
        num_scheduled = out.num_scheduled_tokens
        vocab = self.vocab_size
        for req in out.scheduled:
            rid = req.request_id
            if req.num_computed_tokens + num_scheduled[rid] == len(req.all_token_ids):
                sampled[rid] = next_token(req.all_token_ids, vocab)
        return RunnerOutput(sampled_token_ids=sampled)

    def idle_until(self, t: float) -> None:
        """Let the clock run to virtual time `t` with the GPU idle (a replica waiting for
        arrivals); never moves it back."""
        if t > self.clock:
            self.clock = t

    # ---- sizing -----------------------------------------------------------------------------

    def kv_capacity_blocks(
        self, block_size: int | None = None, gpu_memory_utilization: float = 0.9
    ) -> int:
        """KV blocks that fit in the GPU after the weights, as vLLM sizes its cache:
        (memory * utilization - weight_bytes) // (block_size * kv_bytes_per_token).

        Activation peaks and the CUDA context are not modelled; the (1 - utilization) headroom
        stands in for them.
        """
        block_size = self.block_size if block_size is None else block_size
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        budget = int(self.gpu.memory_bytes * gpu_memory_utilization) - self._weight_bytes
        if budget <= 0:
            raise ValueError(
                f"{self.shape.weight_bytes / 1e9:.1f} GB of weights do not fit in "
                f"{gpu_memory_utilization:.0%} of {self.gpu.name}'s "
                f"{self.gpu.memory_bytes / 2**30:.0f} GiB (tensor parallelism is not simulated)"
            )
        return budget // (block_size * self._kv_bytes)
