"""SimRunner: roofline arithmetic by hand, memory- vs compute-bound regimes, FakeRunner's tokens."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

import fairbatch.engine.sim_runner as sim_runner_module
from fairbatch.engine.gpu_profiles import (
    GPUProfile,
    ModelShape,
    get_profile,
    llama3_8b,
    llama3_70b,
    tiny,
)
from fairbatch.engine.sim_runner import SimRunner
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput
from fairbatch.scheduler.fake_runner import FakeRunner, next_token

VOCAB = 1000
# Round numbers so the tiny case can be worked by hand; efficiency 0.5 keeps bw * eff exact.
TOY_GPU = GPUProfile(
    name="toy", hbm_bandwidth=1e9, peak_flops=1e12, memory_bytes=1 << 20, host_link_bandwidth=1e6
)


def make_output(*chunks: tuple[Request, int], swap_out=(), swap_in=()) -> SchedulerOutput:
    out = SchedulerOutput(swap_out=list(swap_out), swap_in=list(swap_in))
    for req, n in chunks:
        out.scheduled.append(req)
        out.num_scheduled_tokens[req.request_id] = n
        out.total_num_scheduled_tokens += n
    return out


def request(rid: str, num_tokens: int, num_computed: int) -> Request:
    req = Request(rid, [(7 * i + 3) % VOCAB for i in range(num_tokens)], max_tokens=8)
    req.num_computed_tokens = num_computed
    return req


# ---- the shape arithmetic ---------------------------------------------------------------------


def test_model_shape_arithmetic():
    s = tiny()  # L=3, hidden 64, 4 heads, 2 KV heads, head_dim 16, intermediate 128, vocab 512
    # per layer: qkv 64*(4+2*2)*16 = 8192, o 4*16*64 = 4096, mlp 3*64*128 = 24576 -> 36864
    assert s.matmul_params == 3 * 36864 + 512 * 64 == 143360  # + lm_head
    # + 7 RMSNorms of 64, + the embedding table
    assert s.num_params == 143360 + 7 * 64 + 512 * 64 == 176576
    assert s.weight_bytes == 2 * 176576
    assert s.kv_bytes_per_token == 2 * 3 * 2 * 16 * 2 == 384  # K,V x L x kv heads x dim x bf16
    assert s.attention_flops_per_pair == 4 * 4 * 16 * 3 == 768
    assert s.flops_per_token(10) == 2 * 143360 + 10 * 768

    # Published sizes: Llama-3-8B 8.03B, 70B 70.6B parameters; 128 KiB of bf16 K/V per token.
    assert llama3_8b().num_params == 8_030_261_248
    assert llama3_8b().kv_bytes_per_token == 128 * 1024
    assert 70.5e9 < llama3_70b().num_params < 70.6e9
    tied = ModelShape(3, 64, 4, 2, 16, 128, 512, tie_word_embeddings=True)
    assert tied.num_params == s.num_params - 512 * 64
    assert tied.matmul_params == s.matmul_params  # a tied lm_head still multiplies
    with pytest.raises(ValueError, match="multiple"):
        ModelShape(2, 64, 4, 3, 16, 128, 512)


def test_get_profile_is_case_insensitive_and_lists_names():
    assert get_profile("h100") is get_profile("H100-SXM")
    assert get_profile("A100").hbm_bandwidth == 2.039e12
    assert get_profile("h200").memory_bytes == 141 * 2**30
    assert SimRunner(tiny()).gpu.name == "H100-SXM"  # the default
    with pytest.raises(ValueError, match=r"unknown GPU profile 'V100'.*A100.*H100.*H200"):
        get_profile("V100")


# ---- the roofline -----------------------------------------------------------------------------


def test_roofline_tiny_case_by_hand():
    runner = SimRunner(tiny(), TOY_GPU, efficiency=0.5, step_overhead_s=1e-4, block_size=4)
    a = request("a", 8, 0)  # prefill chunk of 5 of its 8 prompt tokens: c=0, n=5
    b = request("b", 10, 9)  # decode: c=9, n=1
    out = make_output((a, 5), (b, 1))
    # N = 6 tokens.
    # bytes = weights 353152 + K/V read ((0+5) + (9+1)) * 384 + K/V written 6 * 384
    #       = 353152 + 15*384 + 6*384 = 361216
    # flops = 6 * 2*143360 + 768 * causal pairs (a: 5*0 + 5*6/2 = 15; b: 1*9 + 1 = 10)
    #       = 1720320 + 768*25 = 1739520
    cost = runner.step_cost(out)
    assert (cost.num_tokens, cost.hbm_bytes, cost.flops) == (6, 361216, 1739520)
    expected = 1e-4 + max(361216 / (1e9 * 0.5), 1739520 / (1e12 * 0.5))
    assert runner.step_time(out) == expected  # exact: the same float operations
    assert cost.bound == "memory" and cost.swap_s == 0.0

    # Two swap-out blocks: 2 * 4 tokens * 384 B over a 1e6 B/s link = 3.072 ms, overlapping the
    # 0.82 ms forward, so the step takes the swap time.
    swapping = make_output((a, 5), (b, 1), swap_out=[(0, 0), (1, 1)])
    assert runner.step_time(swapping) == max(expected, 2 * 4 * 384 / 1e6)
    assert runner.step_cost(swapping).bound == "swap"
    # Swap-only (a controller-asked preemption): overhead vs copies; empty: nothing happens.
    swap_only = make_output(swap_in=[(0, 0)])
    assert runner.step_time(swap_only) == max(1e-4, 4 * 384 / 1e6)
    assert runner.step_cost(swap_only).hbm_bytes == 0
    assert runner.step_time(SchedulerOutput()) == 0.0
    assert runner.clock == 0.0  # step_time is pure


def test_llama3_8b_decode_is_memory_bound_on_h100():
    runner = SimRunner(llama3_8b(), "H100")
    out = make_output((request("d", 513, 512), 1))
    cost = runner.step_cost(out)
    assert cost.bound == "memory"
    weights_s = llama3_8b().weight_bytes / (3.35e12 * 0.7)  # ~6.85 ms
    assert cost.total_s == pytest.approx(weights_s, rel=0.10)


def test_4096_token_prefill_is_compute_bound_on_h100():
    runner = SimRunner(llama3_8b(), "H100")
    out = make_output((request("p", 4096, 0), 4096))
    cost = runner.step_cost(out)
    assert cost.bound == "compute"
    assert cost.math_s > 5 * cost.memory_s
    assert cost.total_s == runner.step_overhead_s + cost.math_s


def test_kv_capacity_blocks():
    runner = SimRunner(llama3_8b(), "H100")
    budget = int(80 * 2**30 * 0.9) - llama3_8b().weight_bytes
    assert runner.kv_capacity_blocks(16) == budget // (16 * 128 * 1024)  # 29205 blocks
    assert runner.kv_capacity_blocks() == runner.kv_capacity_blocks(16)
    assert runner.kv_capacity_blocks(32) == budget // (32 * 128 * 1024)
    with pytest.raises(ValueError, match="do not fit"):
        SimRunner(llama3_70b(), "H100").kv_capacity_blocks(16)


# ---- the runner contract ----------------------------------------------------------------------


def test_sampled_token_rule_and_counters():
    runner = SimRunner(tiny(), TOY_GPU, vocab_size=VOCAB)
    fake = FakeRunner(VOCAB)
    chunk = request("chunk", 8, 0)  # 5 of 8: no token
    done = request("done", 8, 3)  # 3 + 5 == 8: reaches the end, samples
    dec = request("dec", 10, 9)  # decode: samples
    out = make_output((chunk, 5), (done, 5), (dec, 1))
    ro = runner.execute(out)
    assert ro.sampled_token_ids == {
        "done": next_token(done.all_token_ids, VOCAB),
        "dec": next_token(dec.all_token_ids, VOCAB),
    }
    assert ro.sampled_token_ids == fake.execute(out).sampled_token_ids
    assert runner.clock == runner.busy_time == runner.step_time(out) > 0.0
    assert (runner.num_steps, runner.tokens_computed) == (1, 11)
    assert runner.last_cost is not None and runner.last_cost.num_tokens == 11
    runner.idle_until(1.0)
    runner.idle_until(0.5)  # never backwards
    assert runner.clock == 1.0 and runner.busy_time < 1.0
    assert SimRunner(tiny()).vocab_size == 512  # the model's vocab by default


def _requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(8, 96))]
        reqs.append(
            Request(
                f"r{i}",
                prompt,
                max_tokens=rng.randint(4, 48),
                tenant=f"t{i % 4}",
                arrival_time=0.0,
            )
        )
    return reqs


def _run(runner, preemption_mode: str, max_num_seqs: int = 32, n: int = 200, seed: int = 0):
    # 48 blocks of 16 tokens for up to 32 running requests of up to ~144 tokens: preemption is
    # certain. 400 CPU blocks hold every swapped request.
    kv = KVCacheManager(48, 16, num_cpu_blocks=400)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        max_model_len=1024,
        preemption_mode=preemption_mode,
    )
    sched = Scheduler(cfg, kv, make_policy("fcfs", [TenantSpec(f"t{i}") for i in range(4)]))
    for req in _requests(n, seed):
        sched.add_request(req)
    tokens: dict[str, list[int]] = {}
    clocks = [getattr(runner, "clock", 0.0)]
    steps = 0
    while sched.has_unfinished:
        steps += 1
        assert steps < 20_000, "requests did not finish"
        out = sched.schedule()
        ro = runner.execute(out)
        clocks.append(getattr(runner, "clock", 0.0))
        if isinstance(runner, SimRunner):
            assert (clocks[-1] > clocks[-2]) if not out.is_empty else clocks[-1] == clocks[-2]
        for u in sched.update_from_output(out, ro):
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
        sched.check_integrity()
    return tokens, sched


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_full_scheduler_run_matches_fake_runner(mode: str):
    sim = SimRunner(llama3_8b(), "H100", vocab_size=VOCAB, block_size=16)
    got, sched = _run(sim, mode)
    want, _ = _run(FakeRunner(VOCAB), mode)
    assert len(got) == 200 and got == want  # the clock only adds time, never changes tokens
    assert sched.num_preemptions[mode] > 0
    if mode == "swap":
        assert sim.swap_out_blocks > 0 and sim.swap_in_blocks > 0
    assert sim.clock == pytest.approx(sim.busy_time) and sim.clock > 0.0
    # Each position once (every prompt token and every sampled token but the last, which is
    # never fed back; no stop tokens here, so all run to max_tokens), plus recompute's reruns.
    once = sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in _requests(200, 0))
    if sched.num_preemptions["recompute"]:
        assert sim.tokens_computed > once
    else:
        assert sim.tokens_computed == once


def test_batch_64_has_higher_throughput_than_batch_1():
    def tokens_per_virtual_s(max_num_seqs: int) -> float:
        runner = SimRunner(llama3_8b(), "H100", vocab_size=VOCAB)
        kv = KVCacheManager(64 * 5, 16)  # every request fits: 64 x (32 + 32) tokens
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
        sched = Scheduler(cfg, kv, make_policy("fcfs"))
        for i in range(64):
            sched.add_request(Request(f"r{i}", [i + 1] * 32, max_tokens=32, arrival_time=0.0))
        generated = 0
        while sched.has_unfinished:
            out = sched.schedule()
            updates = sched.update_from_output(out, runner.execute(out))
            generated += sum(len(u.new_token_ids) for u in updates)
        assert generated == 64 * 32
        return generated / runner.clock

    # Decode streams all 16 GB of weights per step whatever the batch, so batching 64 requests
    # costs barely more per step than one: the roofline predicts a ~50x gain.
    assert tokens_per_virtual_s(64) > 10 * tokens_per_virtual_s(1)


def test_modules_do_not_import_torch():
    # Import through a stub `fairbatch.engine` package so the check covers these two modules
    # even if engine/__init__ starts importing torch for the real runner.
    engine_dir = str(Path(sim_runner_module.__file__).resolve().parent)
    code = (
        "import sys, types\n"
        "import fairbatch\n"
        "pkg = types.ModuleType('fairbatch.engine')\n"
        f"pkg.__path__ = [{engine_dir!r}]\n"
        "sys.modules['fairbatch.engine'] = pkg\n"
        "import fairbatch.engine.sim_runner, fairbatch.engine.gpu_profiles\n"
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
