"""Autoscaling on Ray's real autoscaler without a cloud: Ray's fake multi-node provider
(`ray.cluster_utils.AutoscalingCluster`'s config) with worker nodes carrying one fake GPU each.

A load ramp makes the controller add replicas; their actors wait for GPU nodes the autoscaler
launches. When the load falls to two long requests, replicas drain (running requests migrate,
waiting ones requeue) and their nodes go idle and away. Every request completes with the
tokens an undisturbed run gives, every KV block comes back, no replica is left behind.

Opt-in (FAIRBATCH_AUTOSCALER_TEST=1) and `slow`: it starts its own Ray head (`ray start`, on a
free port, a private temp dir) and stops only the processes of that session, by id - never
`ray stop`, which would end every Ray on the machine (AutoscalingCluster.start/shutdown run
`ray stop --force`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

import pytest
from live_actors import replica_check

from tests.ray.conftest import sim_tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("FAIRBATCH_AUTOSCALER_TEST") != "1",
        reason="opt-in: FAIRBATCH_AUTOSCALER_TEST=1 (starts its own Ray head and fake nodes)",
    ),
]

MAX_REPLICAS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def autoscaling_ray():
    import ray

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="fbas-", dir="/tmp")
    gpu_node = {"resources": {"CPU": 1, "GPU": 1}, "node_config": {}, "max_workers": MAX_REPLICAS}
    config = fake_multinode_config({"gpu_node": gpu_node}, head_cpus=2)
    config["provider"]["gcs_address"] = f"127.0.0.1:{port}"
    config["idle_timeout_minutes"] = 0.05  # 3 s
    path = os.path.join(tmp, "autoscaling.json")
    with open(path, "w") as f:
        json.dump(config, f)
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # (conftest's): worker nodes join here
    cmd = ["ray", "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0"]
    cmd += [f"--autoscaling-config={path}", f"--temp-dir={tmp}", "--include-dashboard=false"]
    subprocess.check_call(cmd, env=env)
    ray.init(f"127.0.0.1:{port}", namespace="fbas", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        stop_session(tmp, port)


def stop_session(tmp: str, port: int, grace_s: float = 10.0) -> None:
    """SIGTERM this session's processes (only them), then SIGKILL what is left after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(tmp, port):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(tmp, port) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = session_pids(tmp, port)
    assert not left, f"processes of the test's Ray session still running: {left}"


def fake_multinode_config(worker_types: dict, head_cpus: int) -> dict:
    """An autoscaling config for Ray's fake multi-node provider (the node provider ships in the
    wheel; the example YAML `AutoscalingCluster` reads does not, so the config is built here)."""
    head = {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}
    return {
        "cluster_name": "fbas",
        "max_workers": sum(t["max_workers"] for t in worker_types.values()),
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {"ray.head.default": head, **worker_types},
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def session_pids(tmp: str, port: int) -> list[int]:
    # -ww: whole command lines (ps cuts them to $COLUMNS otherwise, and the temp dir is late)
    cmd = ["ps", "-ww", "-eo", "pid=,args="]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if tmp in args or f":{port}" in args:
            pids.append(int(pid))
    return [p for p in pids if p != os.getpid()]


def gpu_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)


def test_ramp_scales_up_then_drains_without_loss(autoscaling_ray):
    import ray

    from fairbatch.deployments.cluster.autoscaling import AutoscalingConfig
    from fairbatch.deployments.cluster.client import ClusterClient, collect
    from fairbatch.deployments.cluster.launch import start_cluster
    from fairbatch.deployments.cluster.replica import ReplicaConfig
    from fairbatch.engine.sampling_params import SamplingParams

    scaling = AutoscalingConfig(
        min_replicas=1,
        max_replicas=MAX_REPLICAS,
        target_queued_tokens_per_replica=400,
        upscale_delay_s=1,
        downscale_delay_s=3,
        smoothing_s=0.5,
        interval_s=0.5,
        drain_timeout_s=60,
    )
    cfg = ReplicaConfig(engine="sim", max_num_seqs=4, num_gpu_blocks=256, time_scale=20.0)
    cluster = start_cluster("as", [cfg], autoscaling=scaling, ready_timeout_s=120)
    client = ClusterClient(cluster.controller)
    prompts = [[1 + i, 2, 3, 4] * 8 for i in range(16)]

    def stats() -> dict:
        return ray.get(cluster.controller.stats.remote(), timeout=30)

    async def ramp() -> list[dict]:
        # 12 requests of 32 + 64 tokens: work wants 3 replicas; then 2 long ones keep running
        # while the others end and the cluster shrinks around them
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        short = SamplingParams(max_tokens=64, ignore_eos=True)
        jobs = [collect(client, p, long if i < 2 else short) for i, p in enumerate(prompts[:12])]
        tasks = [asyncio.ensure_future(j) for j in jobs]
        deadline = time.monotonic() + 120
        while len(stats()["replicas"]) < MAX_REPLICAS and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert len(stats()["replicas"]) == MAX_REPLICAS
        assert gpu_nodes() >= MAX_REPLICAS  # the head has no GPU: each replica has a node
        return await asyncio.gather(*tasks)

    results = asyncio.run(ramp())
    for i, r in enumerate(results):
        n = 400 if i < 2 else 64
        assert r["finish_reason"] == "length"
        assert r["tokens"] == sim_tokens(prompts[i], n, cfg.sim_vocab)  # no gap, no repeat
    deadline = time.monotonic() + 120
    while (len(stats()["replicas"]) > 1 or gpu_nodes() > 1) and time.monotonic() < deadline:
        time.sleep(1)
    s = stats()
    assert len(s["replicas"]) == 1 and gpu_nodes() == 1
    assert s["autoscaling"]["drained"] >= MAX_REPLICAS - 1
    assert s["autoscaling"]["drains_cut"] == 0
    last = next(iter(cluster.replicas.values()))
    check = replica_check(last)
    assert check == {"all_free": True, "requests": 0}
    assert s["queued"] == 0 and not any(s["assigned"].values())
    cluster.shutdown()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if "-r" in n and n.startswith("as-")]
