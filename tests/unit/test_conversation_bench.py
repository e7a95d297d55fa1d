"""The conversation trace replay (benchmarks/conversation_bench.py): block ids become shared
token runs, lengths and arrivals scale, and on sim replicas the host tier serves a later turn
whose history the device pool evicted."""

import json

from fairbatch.benchmarks import conversation_bench as cb

ROWS = [  # two conversations (keys 10 and 20) of the trace's shape, block 0 shared by all
    {"timestamp": 0, "input_length": 1100, "output_length": 64, "hash_ids": [0, 10, 11]},
    {"timestamp": 500, "input_length": 1536, "output_length": 64, "hash_ids": [0, 20, 21]},
    {"timestamp": 4000, "input_length": 2000, "output_length": 64, "hash_ids": [0, 10, 11, 12]},
]


def test_block_ids_become_shared_prefixes_scaled(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert cb.load_trace(str(path), 10) == ROWS  # keys 10, 20, 10: all multiples of 10
    assert cb.load_trace(str(path), 20) == ROWS[1:2]
    reqs = cb.make_requests(ROWS, 8, 2048, 2.0)
    assert [len(r.prompt) for r in reqs] == [18, 24, 32]  # ceil(len x 8 / 512), <= blocks x 8
    assert [r.output_len for r in reqs] == [1, 1, 1]
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 2.0]
    first, other, later = (r.prompt for r in reqs)
    assert later[:18] == first  # the next turn resends the history
    assert other[:8] == first[:8] and other[8:16] != first[8:16]  # only block 0 in common
    assert all(4 <= t < 2048 for r in reqs for t in r.prompt)


def test_the_sim_replay_serves_an_evicted_history_from_the_host_tier():
    rows = [
        {"timestamp": 1000 * i, "input_length": 512 * (i + 2), "output_length": 8,
         "hash_ids": list(range(100 * (i % 3), 100 * (i % 3) + i + 2))}
        for i in range(9)
    ]  # fmt: skip
    base = cb.replay_sim(rows, 2, 0, 1.0, device_blocks=400)
    tier = cb.replay_sim(rows, 2, 4096, 1.0, device_blocks=400)
    assert base["host_hit_rate"] == 0 and tier["host_hit_rate"] > 0
    assert tier["prefill_tokens_computed"] < base["prefill_tokens_computed"]
