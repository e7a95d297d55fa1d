"""`fairbatch bench lora` (benchmarks/lora_bench.py) end to end on the tiny shape: two
requests, two adapters in one slot (so adapters are swapped), a few tokens. Checks the result's
structure and that every case generated every requested token; no timing asserts."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")

from fairbatch.benchmarks import lora_bench  # noqa: E402
from fairbatch.benchmarks.checkpoints import ensure_checkpoint  # noqa: E402


def test_lora_bench_tiny(tmp_path) -> None:
    model = ensure_checkpoint("tiny", root=tmp_path / "ckpt")
    out = tmp_path / "result.json"
    result = lora_bench.main(
        str(out),
        model=str(model),
        num_requests=2,
        prompt_len=5,
        output_len=3,
        adapter_counts=(1, 2),
        max_loras=1,
        max_num_seqs=2,
        rounds=2,
        adapter_root=tmp_path / "adapters",
    )
    assert json.loads(out.read_text()) == result
    assert list(result["cases"]) == ["base", "lora-1", "lora-2"]
    adapters = sorted(p.name for p in (tmp_path / "adapters").glob("*/adapter*"))
    assert adapters == ["adapter000", "adapter001"]
    for name, case in result["cases"].items():
        assert case["all_tokens_generated"], name
        assert len(case["rounds"]) == 2
        for key in ("tok_s", "tok_per_cpu_s", "ttft_p50_ms", "ratio_to_base"):
            assert case[key] > 0, (name, key)
    assert result["cases"]["base"]["ratio_to_base"] == 1.0
    assert result["cases"]["base"]["adapter_loads_per_run"] == 0
    # two adapters through one slot: at least one is (re)loaded in every run
    assert all(r["adapter_loads"] >= 1 for r in result["cases"]["lora-2"]["rounds"])
