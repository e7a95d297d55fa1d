"""The paged Llama-family model against Hugging Face transformers on the same weights."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from fairbatch.engine.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    get_attn_backend,
)
from fairbatch.engine.config import ModelConfig
from fairbatch.engine.loader import load_hf_model
from fairbatch.engine.models import CausalLM
from fairbatch.engine.models.rope import rope_inv_freq
from fairbatch.engine.staging import IntRows

CKPTS = ["llama_ckpt", "llama3_ckpt", "qwen2_ckpt", "mistral_ckpt"]
VOCAB = 512

POISON = 1.0e4  # fills never-written cache slots


@pytest.fixture(scope="module")
def loaded(request: pytest.FixtureRequest) -> dict[str, tuple]:
    """name -> (our model, config, generation dict, HF reference model), loaded once."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            path = request.getfixturevalue(name)
            model, config, gen = load_hf_model(path)
            hf = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
            cache[name] = (model, config, gen, hf)
        return cache[name]

    return get  # type: ignore[return-value]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


class MiniEngine:
    """A paged step loop in miniature: blocks handed out by hand from a shuffled free list,
    chunked prefill under a token budget, and every running sequence in one flattened batch."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, seed: int):
        self.model, self.block_size = model, block_size
        layers = model.config.num_hidden_layers
        # Filled with a huge finite value, so any unmasked read of a slot that was never written
        # throws the output off. (Not NaN: the torch backend reads whole blocks and masks the
        # unwritten tail, and a mask cannot neutralise NaN; the cache engine zero-fills.)
        self.caches = [
            torch.full(model.kv_cache_shape(num_blocks, block_size), POISON) for _ in range(layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def run(self, prompts: list[list[int]], max_new: int, budget: int, caps: list[int]) -> list:
        seqs = [SimpleNamespace(tokens=list(p), done=0, blocks=[], out=[]) for p in prompts]
        step = 0
        while any(len(s.out) < max_new for s in seqs):
            batch, left = [], budget
            for i, s in enumerate(seqs):
                todo = len(s.tokens) - s.done
                if len(s.out) >= max_new or todo == 0 or left == 0:
                    continue
                # Chunk sizes vary per sequence and per step, so chunks of every length and
                # decodes land in the same batch.
                n = min(todo, left, caps[(step + i) % len(caps)])
                while len(s.blocks) * self.block_size < s.done + n:
                    s.blocks.append(self.free.pop())
                batch.append((s, n))
                left -= n
            meta, positions = AttentionMetadata.build(
                [n for _, n in batch],
                [s.done + n for s, n in batch],
                [s.blocks for s, _ in batch],
                self.block_size,
            )
            ids = torch.tensor([t for s, n in batch for t in s.tokens[s.done : s.done + n]])
            hidden = self.model(ids, positions, self.caches, meta)
            ends = meta.query_start_loc[1:].long() - 1  # last row of each sequence
            rows = [k for k, (s, n) in enumerate(batch) if s.done + n == len(s.tokens)]
            if rows:
                logits = self.model.compute_logits(hidden[ends[rows]])
                for k, token in zip(rows, logits.argmax(-1).tolist()):
                    batch[k][0].tokens.append(token)
                    batch[k][0].out.append(token)
            for s, n in batch:
                s.done += n
            step += 1
        return [s.out for s in seqs]


@pytest.mark.parametrize("ckpt", CKPTS)
def test_logits_match_hf(ckpt: str, loaded) -> None:
    model, config, _, hf = loaded(ckpt)
    prompts = _prompts(1, [5, 1, 23, 40, 17])
    lens = [len(p) for p in prompts]
    block_size, rng = 4, random.Random(0)
    free = list(range(64))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(n / block_size))] for n in lens]
    caches = [torch.zeros(model.kv_cache_shape(64, block_size)) for _ in range(3)]
    meta, positions = AttentionMetadata.build(lens, lens, tables, block_size)
    hidden = model(torch.tensor(sum(prompts, [])), positions, caches, meta)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (sum(lens), config.vocab_size)
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[start : start + len(p)], ref, atol=1e-4, rtol=1e-4)
        start += len(p)


@pytest.mark.parametrize("ckpt", CKPTS)
def test_paged_chunked_greedy_matches_hf_generate(ckpt: str, loaded) -> None:
    model, _, gen, hf = loaded(ckpt)
    prompts = _prompts(2, [1, 2, 6, 9, 16, 17, 31, 45, 3])
    max_new = 10
    engine = MiniEngine(model, num_blocks=160, block_size=4, seed=3)
    ours = engine.run(prompts, max_new, budget=24, caps=[3, 7, 1, 12, 5])
    # One left-padded HF batch (9x faster than a generate per prompt, same tokens).
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    refs = hf.generate(
        ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=0
    )[:, width:].tolist()
    for prompt, got, ref in zip(prompts, ours, refs):
        # HF stops a row at an eos id (then pads); the mini engine has no stop rule.
        stop = next((i + 1 for i, t in enumerate(ref) if t in gen["eos_token_ids"]), max_new)
        assert got[:stop] == ref[:stop], f"prompt of {len(prompt)}: {got} vs HF {ref}"


def _naive_attention(q, ks, vs, q_lens, window):
    # q [T, H, D]; ks/vs per sequence [L, Hkv, D]; dense per-query softmax in float64.
    out, row = [], 0
    for k, v, q_len in zip(ks, vs, q_lens):
        seq_len, group = k.shape[0], q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            scores = torch.einsum("hd,lhd->hl", q[row + i].double(), k[lo : p + 1])
            weights = (scores / math.sqrt(q.shape[-1])).softmax(-1)
            out.append(torch.einsum("hl,lhd->hd", weights, v[lo : p + 1]))
        row += q_len
    return torch.stack(out).float()


@pytest.mark.parametrize("window", [None, 5])
def test_torch_backend_matches_dense_reference(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 8, 4, 40
    q_lens, seq_lens = [1, 7, 1, 3, 12, 1], [9, 7, 1, 14, 20, 30]
    ks = [torch.randn(n, kv_heads, dim, generator=gen) for n in seq_lens]
    vs = [torch.randn(n, kv_heads, dim, generator=gen) for n in seq_lens]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(n / block_size))] for n in seq_lens]
    backend = get_attn_backend("torch", "cpu")
    cache = torch.full(backend.kv_cache_shape(num_blocks, block_size, kv_heads, dim), POISON)
    # The earlier context goes in as a previous step; this step's tokens through its metadata.
    ctx = [n - q for n, q in zip(seq_lens, q_lens)]
    done = [(i, c) for i, c in enumerate(ctx) if c]
    prev, _ = AttentionMetadata.build(
        [c for _, c in done], [c for _, c in done], [tables[i] for i, _ in done], block_size
    )
    backend.write_kv(
        torch.cat([ks[i][:c] for i, c in done]),
        torch.cat([vs[i][:c] for i, c in done]),
        cache,
        prev.slot_mapping,
    )
    meta, _ = AttentionMetadata.build(q_lens, seq_lens, tables, block_size)
    backend.write_kv(
        torch.cat([k[c:] for k, c in zip(ks, ctx)]),
        torch.cat([v[c:] for v, c in zip(vs, ctx)]),
        cache,
        meta.slot_mapping,
    )
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    out = backend.forward(q, cache, meta, dim**-0.5, sliding_window=window)
    torch.testing.assert_close(
        out, _naive_attention(q, ks, vs, q_lens, window), atol=1e-5, rtol=1e-5
    )


def test_torch_backend_decode_over_shared_blocks_matches_dense_reference() -> None:
    """Decode sequences whose tables start with the same blocks (prefix-cache hits, forks) run
    as groups over the shared blocks read once: the same attention as each one alone."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 8, 4, 96
    prefix = [torch.randn(n, kv_heads, dim, generator=gen) for n in (24, 8)]  # 6 and 2 blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    prefix_blocks = [[free.pop() for _ in range(n // block_size)] for n in (24, 8)]
    # (prefix, own tokens): 6 on the long prefix (own blocks 2+1+1+2+1+2 > 6 shared: two
    # groups), 2 on the short one (one just past a block boundary), one with nothing shared
    seqs = [(0, 5), (0, 1), (0, 4), (0, 7), (0, 2), (0, 6), (1, 1), (1, 4), (None, 9)]
    ks, vs, tables = [], [], []
    for which, own in seqs:
        shared = 0 if which is None else prefix[which].shape[0]
        k = torch.randn(shared + own, kv_heads, dim, generator=gen)
        v = torch.randn(shared + own, kv_heads, dim, generator=gen)
        if which is not None:
            k[:shared] = prefix[which]
            v[:shared] = -prefix[which]
        first = [] if which is None else prefix_blocks[which]
        own_blocks = math.ceil((shared + own) / block_size) - len(first)
        tables.append(first + [free.pop() for _ in range(own_blocks)])
        ks.append(k)
        vs.append(v)
    seq_lens = [k.shape[0] for k in ks]
    backend = get_attn_backend("torch", "cpu")
    cache = torch.full(backend.kv_cache_shape(num_blocks, block_size, kv_heads, dim), POISON)
    for k, v, table in zip(ks, vs, tables):  # (shared blocks written once per sequence: alike)
        meta, _ = AttentionMetadata.build([k.shape[0]], [k.shape[0]], [table], block_size)
        backend.write_kv(k, v, cache, meta.slot_mapping)
    meta, _ = AttentionMetadata.build([1] * len(seqs), seq_lens, tables, block_size)
    q = torch.randn(len(seqs), heads, dim, generator=gen)
    out = backend.forward(q, cache, meta, dim**-0.5)
    plan = meta._cache[("torch", block_size, kv_heads, heads // kv_heads, None)]
    ((rows, *_),) = plan.shared  # one padded call: groups padded with their first member
    groups = sorted(list(dict.fromkeys(r)) for r in rows.tolist())
    assert groups == [[1, 4, 2, 0], [5, 3], [6, 7]]
    torch.testing.assert_close(
        out, _naive_attention(q, ks, vs, [1] * len(seqs), None), atol=1e-5, rtol=1e-5
    )


def test_metadata_build_slots_and_positions() -> None:
    meta, positions = AttentionMetadata.build([3, 1], [5, 6], [[7, 2], [4, 9]], block_size=4)
    assert positions.tolist() == [2, 3, 4, 5]
    # seq 0 positions 2, 3 in block 7, position 4 in block 2; seq 1 position 5 in block 9
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)


@pytest.mark.parametrize("seed", range(20))
def test_host_inputs_match_a_per_token_reference(seed: int) -> None:
    """Random steps of prompt chunks and decodes, tables (lists, or the runner's arrays) with
    blocks allocated ahead, padded to their own width or to a graph's wider one: every input
    equals its per-token definition."""
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    num_seqs = rng.randrange(0, 12)
    q_lens = [rng.choice([1, 1, rng.randrange(1, 40)]) for _ in range(num_seqs)]
    lens = [q + rng.randrange(0, 100) for q in q_lens]
    tables = [
        rng.sample(range(10_000), -(-n // bs) + rng.randrange(0, 3)) for n in lens
    ]  # fmt: skip
    need = max(map(len, tables), default=0) or 1
    width = rng.choice([None, need, need + rng.randrange(1, 500)])
    rows = IntRows()  # the runner passes int32 arrays; lists work alike
    given = [rows.row(str(s), t) if seed % 2 else t for s, t in enumerate(tables)]
    host = AttentionMetadata.host_inputs(q_lens, lens, given, bs, width)
    positions = [n - q + i for q, n in zip(q_lens, lens) for i in range(q)]
    rows = [s for s, q in enumerate(q_lens) for _ in range(q)]
    slots = [tables[s][p // bs] * bs + p % bs for s, p in zip(rows, positions)]
    cols = width or need
    assert host["positions"].tolist() == positions
    assert host["slot_mapping"].tolist() == slots
    assert host["query_start_loc"].tolist() == [sum(q_lens[:i]) for i in range(num_seqs + 1)]
    assert host["seq_lens"].tolist() == lens
    assert host["block_tables"].tolist() == [t + [0] * (cols - len(t)) for t in tables]
    assert host["block_tables"].shape == (num_seqs, cols)
    assert host["positions"].dtype == host["slot_mapping"].dtype == torch.int64
    for key in ("query_start_loc", "seq_lens", "block_tables"):
        assert host[key].dtype == torch.int32


def test_host_inputs_refuse_a_table_wider_than_the_width() -> None:
    with pytest.raises(ValueError, match="sequence 1: 3 blocks do not fit a table 2 wide"):
        AttentionMetadata.host_inputs([1, 1], [4, 9], [[5], [6, 7, 8]], 4, width=2)


def test_backend_registry() -> None:
    assert isinstance(get_attn_backend(None, "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attn_backend("xformers", "cpu")
    with pytest.raises(ValueError, match="cannot run here"):
        get_attn_backend("flash", "cpu")


def _hf_config(**overrides) -> dict:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 128,
    }
    return {**base, **overrides}


def test_config_parsing() -> None:
    c = ModelConfig.from_hf_dict(_hf_config(eos_token_id=[7, 8], rope_theta=500000.0))
    assert (c.num_key_value_heads, c.head_dim, c.eos_token_ids) == (2, 8, (7, 8))
    assert (c.rope_theta, c.rope_scaling, c.sliding_window) == (500000.0, None, None)
    # transformers 4.x layout with the old `type` key
    old = ModelConfig.from_hf_dict(_hf_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    qwen = ModelConfig.from_hf_dict(
        _hf_config(
            architectures=["Qwen2ForCausalLM"], sliding_window=4096, tie_word_embeddings=True
        )
    )
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.tie_word_embeddings
    assert qwen.sliding_window is None  # use_sliding_window is off
    mistral = {"architectures": ["MistralForCausalLM"]}
    assert (
        ModelConfig.from_hf_dict(_hf_config(**mistral, sliding_window=128)).sliding_window is None
    )
    assert ModelConfig.from_hf_dict(_hf_config(**mistral, sliding_window=32)).sliding_window == 32


def test_config_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        ModelConfig.from_hf_dict(_hf_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelConfig.from_hf_dict(_hf_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(
            _hf_config(
                architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64
            )
        )


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_inv_freq_matches_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        rope_parameters={**rope, "rope_theta": 10000.0},
    )
    ours = rope_inv_freq(ModelConfig.from_hf_dict(hf_config.to_dict()))
    if rope["rope_type"] == "default":
        ref = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_loader_generation_defaults_and_sharding(llama_ckpt: Path, llama3_ckpt: Path) -> None:
    _, config, gen = load_hf_model(llama_ckpt)
    assert gen["eos_token_ids"] == [2, 5] and config.eos_token_ids == (2,)
    assert (llama3_ckpt / "model.safetensors.index.json").is_file()
    assert len(list(llama3_ckpt.glob("model-*.safetensors"))) > 1
    model, config, _ = load_hf_model(llama3_ckpt)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    assert next(model.parameters()).dtype == torch.float32


def test_loader_errors(tmp_path: Path, qwen2_ckpt: Path, llama3_ckpt: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(qwen2_ckpt / "config.json", bare)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_model(bare)

    # A checkpoint without one tensor names it.
    broken = tmp_path / "broken"
    shutil.copytree(qwen2_ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_hf_model(broken)

    # An index listing a shard that is not there names the shard.
    sharded = tmp_path / "sharded"
    shutil.copytree(llama3_ckpt, sharded)
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_hf_model(sharded)

    # An architecture we do not run is refused before any weight is read.
    alien = tmp_path / "alien"
    alien.mkdir()
    config = json.loads((qwen2_ckpt / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (alien / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_hf_model(alien)


def test_torch_backend_cache_is_head_major_inside_a_block() -> None:
    """write_kv puts token t of the step at cache[0|1][block, head, offset]; the flash layout
    (block, offset, head) is the other backend's."""
    backend = get_attn_backend("torch", "cpu")
    assert backend.kv_cache_shape(5, 4, 2, 3) == (2, 5, 2, 4, 3)
    cache = torch.zeros(backend.kv_cache_shape(5, 4, 2, 3))
    meta, _ = AttentionMetadata.build([3], [3], [[2]], block_size=4)  # slots 8, 9, 10
    key = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3)
    backend.write_kv(key, -key, cache, meta.slot_mapping)
    for t in range(3):
        for h in range(2):
            assert torch.equal(cache[0, 2, h, t], key[t, h])
            assert torch.equal(cache[1, 2, h, t], -key[t, h])
    assert cache[:, [0, 1, 3, 4]].abs().sum() == 0 and cache[:, 2, :, 3].abs().sum() == 0


def test_block_rows_follow_a_growing_table_and_copy_a_rebuilt_one() -> None:
    rows = IntRows()
    table = [7, 3]
    assert rows.row("a", table).tolist() == [7, 3]
    table += [9, *range(100, 140)]  # grows in place, past the first buffer
    assert rows.row("a", table).tolist() == table
    table.append(5)
    assert rows.row("a", table).tolist() == table
    # rebuilt (swapped in, re-admitted): a new list, even of the same length, is copied anew
    rebuilt = [1] * len(table)
    assert rows.row("a", rebuilt).tolist() == rebuilt
    assert rows.row("a", []).tolist() == []
    assert rows.row("b", [4]).tolist() == [4] and rows.row("a", rebuilt).tolist() == rebuilt
    rows.check({"a": rebuilt, "b": [4]})  # ("b": another list than the one kept: not checked)
    rebuilt[0] = 2  # changed in place, against the KV manager's contract: the check finds it
    with pytest.raises(AssertionError, match="a: kept row differs"):
        rows.check({"a": rebuilt})


def test_block_rows_forget_tables_that_are_gone_or_rebuilt() -> None:
    rows = IntRows()
    live = {f"r{i}": [i] for i in range(300)}
    for rid, table in live.items():
        rows.row(rid, table)
    rows.prune(live)
    assert len(rows) == 300  # all live: none dropped
    for i in range(250):
        del live[f"r{i}"]  # finished
    live["r250"] = [1, 2]  # rebuilt
    rows.prune(live)
    assert len(rows) == 49  # r251 .. r299
    assert rows.row("r250", live["r250"]).tolist() == [1, 2]
    for i in range(40):
        del live[f"r{251 + i}"]
    rows.prune(live)  # 50 rows for 10 live: not yet worth a pass (amortised)
    assert len(rows) == 50
