"""The CUDA step's transfers, checked on CPU: what crosses between host and device per step.

A CUDA step may copy to the device only through staging (one copy for the runner's inputs,
one for the sampler's settings) and may wait for the device once, reading the sampled tokens,
logprobs and prompt logprobs together. Two harnesses check it without a GPU:

* the meta device stands in for CUDA: the runner, its model and KV cache live on it, so any
  read of device values (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`) raises, and a dispatch
  mode fails any op that feeds a host tensor into device work and counts host->device copies;
* the staged CPU runner (the CUDA code path on CPU tensors) must give exactly the outputs of
  the plain CPU path, with graphs replayed by an eager stand-in too.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine import runner as runner_mod
from fairbatch.engine.attention import AttentionMetadata
from fairbatch.engine.cuda_graphs import DecodeGraphs
from fairbatch.engine.runner import ModelRunner
from fairbatch.engine.sampler import Sampler
from fairbatch.engine.staging import Staging
from fairbatch.kv.cache_engine import CacheEngine

aten = torch.ops.aten
COPIES = (aten.copy_.default, aten._to_copy.default, aten.to.dtype_layout, aten.to.device)

# Every sampling feature, several prompt lengths (chunked prefill with a small token budget
# gives prefill, mixed and decode steps), prompt logprobs on some.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2, max_tokens=6, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0, logit_bias={7: 4.0, 9: -100.0}, max_tokens=6,
                   ignore_eos=True, prompt_logprobs=0),
    SamplingParams(temperature=0.7, seed=11, max_tokens=6, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
]  # fmt: skip
PROMPTS = [f"transfer check {i} " * (1 + 3 * i) for i in range(len(PARAMS))]
ENGINE = dict(num_gpu_blocks=256, max_num_batched_tokens=24, seed=5)


class _DeviceOps(TorchDispatchMode):
    """With the meta device as "the device": counts host->device copies and fails any other op
    that takes a host tensor (not a 0-d scalar) into device work (CUDA would refuse it, or
    copy behind our back)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors):
            host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
            if host and func in COPIES:
                self.copies += 1
            elif host:
                raise AssertionError(f"{func} takes host tensors into device work")
        return out


def _meta_runner(cpu_runner: ModelRunner) -> ModelRunner:
    """The CPU runner's model and KV cache on the meta device, staged as on CUDA."""
    layout = cpu_runner.cache.layout
    src = cpu_runner.model  # (its linears are packed for oneDNN: opaque, so built anew)
    with torch.device("meta"):
        model = type(src)(src.config, src.attn_backend_name)
    # RoPE's inverse frequencies follow the model on its first forward (once, not per step;
    # on CUDA build_engine's profiling step or the graph warm-up does it)
    model.model.rotary.inv_freq = model.model.rotary.inv_freq.to("meta")
    cache = CacheEngine(layout, cpu_runner.cache.gpu_cache.shape[2], 0, "meta")
    return ModelRunner(model, cache, Sampler(), stage_inputs=True)


def _fake_read(tensors):
    # Zeros of the right shapes: token 0 is a valid id; the step's values do not matter here.
    return [torch.zeros(t.shape, dtype=t.dtype).tolist() for t in tensors]


def test_a_step_copies_through_staging_only_and_reads_once(monkeypatch):
    llm = LLM("tiny", **ENGINE)
    runner = _meta_runner(llm.engine.runner)
    llm.engine.runner = runner
    reads = []
    monkeypatch.setattr(runner_mod, "read_to_host", lambda t: reads.append(len(t)) or _fake_read(t))
    steps = []  # per step: (device copies, runner uploads, sampler uploads, reads, sampled)
    execute = runner.execute

    def counted(out):
        ops, before = _DeviceOps(), (runner.staging.num_uploads, len(reads))
        sampler_before = runner.sampler.staging.num_uploads if runner.sampler.staging else 0
        with ops:
            result = execute(out)
        sampler_uploads = runner.sampler.staging.num_uploads - sampler_before
        steps.append((ops.copies, runner.staging.num_uploads - before[0], sampler_uploads,
                      len(reads) - before[1], len(result.sampled_token_ids)))  # fmt: skip
        return result

    runner.execute = counted
    # meta has no random generators: the seeded row goes unseeded (seeding is host-side work)
    params = [SamplingParams(**{**vars(p), "seed": None}) for p in PARAMS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.token_ids) == 6 for o in outs)
    # a long prompt alone: its first chunks sample nothing and only score prompt positions
    scored = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    llm.generate(["one long prompt " * 30], scored, use_tqdm=False)
    assert len(steps) > 8 and any(s[4] == 0 for s in steps)
    for copies, runner_uploads, sampler_uploads, num_reads, _ in steps:
        assert runner_uploads == 1  # the step's inputs, attention plan and row indices
        assert sampler_uploads <= 1  # the sampler's settings (none for an all-greedy batch)
        assert copies == runner_uploads + sampler_uploads  # nothing else crossed
        assert num_reads == 1  # one wait, even for steps that only score prompt positions
    assert sum(s[2] for s in steps) > 0


def test_an_all_greedy_decode_step_stages_no_sampler_settings():
    sampler = Sampler()
    logits = torch.randn(3, 40)
    out = sampler.sample(logits, [SamplingParams(temperature=0)] * 3, [[1]] * 3, [[]] * 3)
    assert out.token_ids == logits.argmax(-1).tolist() and sampler.staging is None


def _outputs(llm: LLM):
    return [
        (o.token_ids, o.logprobs, o.prompt_logprobs)
        for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    ]


class _EagerGraphs(DecodeGraphs):
    """Stands in for captured graphs on CPU: "replay" runs the forward eagerly on the static
    views, reading each row's length from them (as the flash kernel reads `seq_lens`)."""

    def capture(self) -> None:
        self._graphs = {b: (None, None, self.views(b)["ids"].data_ptr()) for b in self.sizes}

    def replay(self, batch: int, staged_ids: torch.Tensor) -> torch.Tensor:
        v = self.views(batch)
        assert staged_ids.data_ptr() == v["ids"].data_ptr()
        lens = v["seq_lens"].tolist()
        meta, positions = AttentionMetadata.from_device(v, [1] * batch, lens, v["block_tables"])
        return self.model(v["ids"].long(), positions, self.kv_caches, meta)


@pytest.mark.parametrize("graphs", [False, True])
def test_staged_path_gives_the_plain_cpu_outputs(graphs):
    ref = _outputs(LLM("tiny", **ENGINE))
    llm = LLM("tiny", **ENGINE)
    runner = llm.engine.runner
    runner.staging = Staging("cpu")
    if graphs:  # a cache with a pad block, as build_engine makes for graphs
        plain = runner.cache
        runner.cache = CacheEngine(plain.layout, plain.gpu_cache.shape[2], 0, pad_block=True)
        runner.kv_caches = runner.cache.layer_caches()
        runner.graphs = _EagerGraphs(runner.model, runner.kv_caches, runner.block_size, 8, 256,
                                     runner.cache.pad_block)  # fmt: skip
        runner.graphs.capture()
    got = _outputs(llm)
    assert got == ref  # tokens, logprobs and prompt logprobs, exactly
    assert runner.staging.num_uploads == runner.num_steps
    assert (runner.num_graph_steps > 0) == graphs
