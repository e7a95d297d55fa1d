"""`fairbatch bench serve --compare serving-path --sim-time-scale S`: the offline baseline is one
simulated engine paced like its GPU, its rate times the replicas; local_http and engines (the
tiny model's paths) are refused."""

from __future__ import annotations

import argparse

import pytest

from fairbatch.benchmarks.serving_path import (
    choose_paths,
    prompts,
    run,
    sim_offline_run,
    workload,
)
from fairbatch.deployments.cluster.replica_config import ReplicaConfig, build_core
from fairbatch.engine import SamplingParams
from fairbatch.engine.tokenizer import Tokenizer


def args(**kw) -> argparse.Namespace:
    base = dict(
        num_prompts=8,
        input_len="fixed:16",
        output_len="fixed:8",
        concurrency=4,
        replicas=2,
        max_num_seqs=4,
        num_gpu_blocks=64,
        intervals="50",
        proxy=False,
        rounds=1,
        sim_time_scale=1.0,
        paths="offline",
        seed=0,
        no_plots=True,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def modelled_seconds(ids: list[list[int]], wl: dict) -> float:
    """The simulated GPU time of one replica's share, stepped unpaced."""
    cfg = ReplicaConfig(engine="sim", max_num_seqs=wl["seats"], num_gpu_blocks=64)
    core = build_core(cfg)
    params = SamplingParams(max_tokens=wl["output_len"], temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ids):
        core.add_request(p, params, request_id=str(i))
    total = 0.0
    while core.has_unfinished():
        core.step()
        total += core.runner.last_cost.total_s
    return total


def test_the_sim_baseline_is_one_paced_engine_times_the_replicas():
    wl = workload(args())
    assert (wl["model"], wl["time_scale"]) == ("sim", 1.0)
    ids = prompts(8, 16, Tokenizer.tiny().vocab_size, 0)
    row = sim_offline_run(ids, wl)
    # every request of the 2 replicas' shares counted, all tokens
    assert (row["requests"], row["ok"], row["output_tokens"]) == (8, 8, 64)
    # paced: at least the share's modelled GPU time x the scale
    assert row["duration_s"] >= modelled_seconds(ids[:4], wl) * 0.999
    assert row["output_tok_s"] == pytest.approx(64 / row["duration_s"], rel=0.02)


@pytest.mark.parametrize("path", ["local_http", "engines"])
def test_the_tiny_model_paths_are_refused_with_the_sim_replicas(tmp_path, path):
    with pytest.raises(SystemExit, match="tiny model only"):
        run(args(paths=path), {}, tmp_path)
    with pytest.raises(SystemExit, match=">= 0"):
        workload(args(sim_time_scale=-1.0))


def test_the_default_paths_are_those_the_model_runs():
    sim, tiny = workload(args()), workload(args(sim_time_scale=0.0))
    assert choose_paths(None, sim) == ["offline", "serve_http", "handle"]
    assert choose_paths(None, tiny) == ["offline", "engines", "local_http", "serve_http", "handle"]
    assert choose_paths("handle,offline", tiny) == ["handle", "offline"]
    with pytest.raises(SystemExit, match="unknown nope"):
        choose_paths("offline,nope", tiny)


def test_a_model_directory_replaces_the_tiny_model_where_it_can(tmp_path):
    """`--model DIR` runs a checkpoint in `offline` and the Serve paths; the tiny-only paths
    drop out, a path that is no directory and a model with --sim-time-scale are refused."""
    wl = workload(args(sim_time_scale=0.0, model=str(tmp_path)))
    assert wl["model"] == str(tmp_path)
    assert choose_paths(None, wl) == ["offline", "serve_http", "handle"]
    with pytest.raises(SystemExit, match="tiny model only"):
        choose_paths("engines", wl)
    with pytest.raises(SystemExit, match="model directory"):
        workload(args(sim_time_scale=0.0, model=str(tmp_path / "missing")))
    with pytest.raises(SystemExit, match="not with --model"):
        workload(args(model=str(tmp_path)))
