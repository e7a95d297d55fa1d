"""`fairbatch bench serve --compare serving-path --paths engines`: the replicas' engines alone,
one process each, side by side, with the app's workload split between them."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import torch

from fairbatch.benchmarks.serving_path import (
    _involuntary_switches,
    _tiny_engine,
    by_role,
    engine_processes,
    engines_run,
    prompts,
)
from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.tokenizer import Tokenizer

WL = {"replicas": 2, "seats": 2, "num_gpu_blocks": 64, "output_len": 8, "prompt_len": 12}


def test_each_request_runs_once_on_its_engine_with_the_replicas_tokens():
    ids = prompts(5, WL["prompt_len"], Tokenizer.tiny().vocab_size, 3)
    with engine_processes(ids, WL) as (_, go):
        outs, seconds = go()
    assert seconds > 0
    # the reference: one engine as a replica runs it (its seats, one torch thread), greedy
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM("tiny", max_num_seqs=WL["seats"], num_gpu_blocks=WL["num_gpu_blocks"])
        params = SamplingParams(max_tokens=WL["output_len"], temperature=0.0, ignore_eos=True)
        want = [(list(o.token_ids), o.finish_reason) for o in llm.generate(ids, params)]
    finally:
        torch.set_num_threads(threads)
    assert outs == want  # in the prompts' order, every one whole
    assert all(len(tokens) == WL["output_len"] for tokens, _ in outs)


def test_an_engine_process_that_dies_is_a_clear_error_not_a_hang():
    broken = {k: v for k, v in WL.items() if k != "num_gpu_blocks"}  # the child's KeyError
    with pytest.raises(RuntimeError, match="failed to start: exited with code 1"):
        with engine_processes(prompts(2, 4, Tokenizer.tiny().vocab_size, 0), broken):
            pass


def test_the_engines_row_counts_the_engine_processes_as_the_replicas():
    ids = prompts(6, WL["prompt_len"], Tokenizer.tiny().vocab_size, 4)
    row = engines_run(ids, WL)
    assert (row["path"], row["requests"], row["ok"], row["output_tokens"]) == ("engines", 6, 6, 48)
    # the children's CPU is the replicas'; this process only waited on their pipes (how
    # much less it used depends on how busy the cores were: only the order is checked)
    assert row["cpu_s"]["replicas"] > 0
    assert row["cpu_s"]["replicas"] > row["cpu_s"].get("client", 0.0)
    assert row["replica_share"] > 0
    assert all(v >= 0 for v in row["preemptions_per_s"].values())


def test_by_role_sums_cpu_and_preemptions_between_snapshots():
    before = {1: ("replicas", 1.0, 10), 2: ("client", 0.5, 3), 9: ("replicas", 4.0, 7)}
    after = {  # 3 was born in between (counts whole); 4 is not ours; 9 is gone
        1: ("replicas", 2.5, 40),
        2: ("client", 0.7, 3),
        3: ("replicas", 0.25, 5),
        4: ("other", 9.0, 9),
    }
    assert by_role(before, after) == {"client": 0.2, "replicas": 1.75}
    assert by_role(before, after, field=2) == {"replicas": 35}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread counts from /proc")
def test_preemptions_count_every_thread_not_only_the_main_one():
    # a process whose main thread waits while another thread computes, on cores that more
    # computing processes than there are cores keep full: that thread is preempted, not main
    code = (
        "import threading, time\n"
        "def spin():\n"
        "    end = time.monotonic() + 4.0\n"
        "    while time.monotonic() < end: pass\n"
        "t = threading.Thread(target=spin); t.start(); t.join()\n"
        "time.sleep(30)\n"
    )
    spin = "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass\n"
    target = subprocess.Popen([sys.executable, "-c", code])
    others = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        for p in others:
            p.wait(timeout=60)
        proc = psutil.Process(target.pid)  # its thread still runs (an ended thread's count goes)
        threads = _involuntary_switches(proc)
        main_only = proc.num_ctx_switches().involuntary
        assert threads > main_only + 10
    finally:
        target.kill()
        target.wait()


def test_a_path_computes_every_prompt_it_is_sent_again():
    # The paths send the same prompts to one server in turn (warm-up, then each path): with a
    # prefix cache the later sends would skip their prompts' full blocks (40 tokens: two).
    wl = {**WL, "prompt_len": 40}
    ids = prompts(4, wl["prompt_len"], Tokenizer.tiny().vocab_size, 0)
    llm, params = _tiny_engine(WL["seats"], wl, ids)  # warmed up on these very prompts
    assert [o.num_cached_tokens for o in llm.generate(ids, params)] == [0] * 4
    assert [o.num_cached_tokens for o in llm.generate(ids, params)] == [0] * 4
