"""The autoscaling policy on recorded traces (exact decisions, injected clock) and the drain's
actions on a FairnessCore driven by hand-made reports. Pure Python."""

from __future__ import annotations

import math

import pytest

from fairbatch.deployments.cluster.autoscaling import (
    Autoscaler,
    AutoscalingConfig,
    ClusterLoad,
    Requeue,
    drain_actions,
    drain_choice,
    drained,
    measure,
)
from fairbatch.deployments.cluster.fairness import Assign, ControllerConfig, FairnessCore, Migrate
from fairbatch.deployments.cluster.wire import ReplicaReport, RequestMeta
from fairbatch.engine.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def load(work: float, used: int = 0, total: int = 1000, served: int = 0) -> ClusterLoad:
    return ClusterLoad(work, used, total, served)


def run_trace(scaler: Autoscaler, clock: Clock, trace) -> list[int]:
    out = []
    for t, ld in trace:
        clock.now = t
        out.append(scaler.observe(ld).replicas)
    return out


def test_ramp_up_and_down_with_delays_and_tolerance():
    cfg = AutoscalingConfig(
        min_replicas=1,
        max_replicas=8,
        target_queued_tokens_per_replica=1000,
        upscale_delay_s=2,
        downscale_delay_s=5,
        smoothing_s=0,  # raw signals: the delays alone make the hysteresis here
        tolerance=0.2,
    )
    clock = Clock()
    scaler = Autoscaler(cfg, current=1, clock=clock)
    trace = [
        (0, load(500)),  # 1 wanted
        (1, load(3500)),  # 4 wanted: the wish starts
        (2, load(3500)),
        (3, load(3500)),  # held 2 s: up to 4
        (4, load(3100)),  # 4 (shrinking counts against 800 per replica: 4)
        (5, load(2500)),  # up-count 3, but 2500 / 800 -> 4: the tolerance band holds 4
        (6, load(2000)),  # 3 wanted: the wish to shrink starts
        (8, load(6000)),  # a spike: the wish turns to growing (and restarts)
        (9, load(2000)),  # shrinking again, from 9
        (13, load(2000)),
        (14, load(2000)),  # held 5 s: down to 3
        (15, load(20000)),  # 20 wanted, capped at 8, after 2 s
        (17, load(20000)),
        (18, load(0)),
        (30, load(0)),  # min_replicas
    ]
    assert run_trace(scaler, clock, trace) == [1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 3, 3, 8, 8, 1]


def test_kv_usage_asks_for_replicas_when_work_does_not():
    cfg = AutoscalingConfig(
        max_replicas=8,
        target_queued_tokens_per_replica=1e6,
        target_kv_usage=0.8,
        upscale_delay_s=0,
        downscale_delay_s=0,
        smoothing_s=0,
    )
    clock = Clock()
    scaler = Autoscaler(cfg, current=2, clock=clock)
    d = scaler.observe(load(10, used=900, total=1000))
    assert (d.replicas, d.wanted) == (3, 3)  # ceil(2 x 0.9 / 0.8)
    clock.now = 1
    assert scaler.observe(load(10, used=500, total=1500)).replicas == 2  # 3 x 1/3 / 0.8


def test_smoothing_and_throughput_are_exponential_averages():
    cfg = AutoscalingConfig(target_queued_tokens_per_replica=1000, smoothing_s=1.0)
    clock = Clock()
    scaler = Autoscaler(cfg, current=1, clock=clock)
    scaler.observe(load(0, served=0))
    clock.now = 1.0
    d = scaler.observe(load(1000, served=500))
    a = 1 - math.exp(-1.0)
    assert d.work_tokens == pytest.approx(1000 * a)
    assert d.tokens_per_s == pytest.approx(500 * a)
    assert d.wanted == 1  # 632 smoothed tokens: one replica


@pytest.mark.parametrize(
    "kw",
    [
        dict(min_replicas=0),
        dict(min_replicas=3, max_replicas=2),
        dict(target_kv_usage=1.5),
        dict(target_queued_tokens_per_replica=0),
        dict(upscale_delay_s=-1),
        dict(tolerance=1.0),
    ],
)
def test_config_is_validated(kw):
    with pytest.raises(ValueError):
        AutoscalingConfig(**kw)


def test_app_config_validates_autoscaling():
    from fairbatch.deployments.api.config import ConfigError
    from fairbatch.deployments.serve.app import parse_app_args

    ok = parse_app_args({"model": "sim", "autoscaling": {"min_replicas": 1, "max_replicas": 4}})
    assert ok.autoscaling_config().max_replicas == 4
    assert ok.initial_replicas() == 1
    with pytest.raises(ConfigError, match="autoscaling"):
        parse_app_args({"autoscaling": {"max_replica": 4}})
    with pytest.raises(ConfigError, match="autoscaling"):
        parse_app_args({"autoscaling": {"min_replicas": 5, "max_replicas": 4}})


# ---- draining ---------------------------------------------------------------------------------


def meta(rid: str, n: int = 10) -> RequestMeta:
    return RequestMeta(rid, list(range(1, n + 1)), SamplingParams(max_tokens=n, ignore_eos=True))


def report(replica_id: str, seq: int, active=None, finished=()) -> ReplicaReport:
    return ReplicaReport(
        replica_id=replica_id,
        seq=seq,
        max_num_seqs=1,
        free_blocks=60,
        total_blocks=100,
        block_size=16,
        num_waiting=0,
        num_running=0,
        num_swapped=0,
        num_steps=0,
        service={},
        finished=list(finished),
        active=active or {},
    )


def test_drain_migrates_running_requeues_waiting_and_takes_no_new_work():
    core = FairnessCore(ControllerConfig(local_queue=1))
    core.report(report("r0", 1))
    core.report(report("r1", 2))
    placed = {}
    for i in range(4):
        placed.update((a.ticket.request_id, a.replica_id) for a in core.submit(meta(f"q{i}")))
    on_r0 = sorted(rid for rid, r in placed.items() if r == "r0")
    assert len(on_r0) == 2
    run, wait = on_r0
    active = {run: ("default", 0, True, 10, 3), wait: ("default", 0, False, 10, 0)}
    core.report(report("r0", 3, active))
    assert measure(core).work_tokens == 4 * 20
    assert measure(core).used_blocks == 80
    assert drain_choice(core, ["r0", "r1"], 1) == ["r1"]  # r1's requests were never seen running

    actions = drain_actions(core, "r0")
    assert [type(a) for a in actions] == [Migrate, Requeue]
    assert (actions[0].request_id, actions[0].dst) == (run, "r1")
    assert actions[1].request_id == wait
    assert wait not in core.tickets  # its resubmission is a new ticket
    assert drained(core, "r0")
    # the requeued request comes back; r0 takes nothing new, r1 is full: it waits in the queue
    again = meta(wait)
    again.attempt = 1
    assert not [a for a in core.submit(again) if isinstance(a, Assign)]
    assert core.stats()["queued"] == 1
    assert drain_actions(core, "r0") == []
    core.remove_replica("r0")
    assert "r0" not in core.replicas
