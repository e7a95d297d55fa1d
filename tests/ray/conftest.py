"""Ray tests: one local Ray per test module, fake GPUs, no auth, no usage stats, a private tmp.

Set before ray is imported anywhere in the session (Ray 2.60 turns token auth on by
default, and the default temp dir is shared with other engineers' runs).
"""

from __future__ import annotations

import os
import tempfile

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# Ray's single-machine mode (what it uses on macOS and Windows): its node address is 127.0.0.1,
# so Ray's own traffic stays on loopback like the tests'. (On Linux Ray takes the machine's
# network address, even when asked for 127.0.0.1.) The opt-in multi-node tests drop it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
_TMP = tempfile.mkdtemp(prefix="fbray-", dir="/tmp")
os.environ.setdefault("RAY_TMPDIR", _TMP)

import pytest  # noqa: E402


def start_ray(num_gpus: int) -> None:
    import ray

    ray.init(
        num_cpus=2,
        num_gpus=num_gpus,
        include_dashboard=False,
        _temp_dir=os.environ["RAY_TMPDIR"],
        log_to_driver=False,
        configure_logging=False,
    )


@pytest.fixture(scope="session")
def ray_tmp() -> str:
    return os.environ["RAY_TMPDIR"]


@pytest.fixture(scope="session", autouse=True)
def _remove_ray_tmp():
    yield
    import shutil

    shutil.rmtree(_TMP, ignore_errors=True)  # only the folder this session made


def sim_tokens(prompt: list[int], n: int, vocab: int = 1000) -> list[int]:
    """The tokens the simulated runner produces for `prompt`: a pure function of the history,
    so any correct run (chunked, preempted, moved, resubmitted) yields exactly these."""
    from fairbatch.scheduler.fake_runner import next_token

    history, out = list(prompt), []
    for _ in range(n):
        token = next_token(history, vocab)
        history.append(token)
        out.append(token)
    return out


def check_replicas(clusters: list, timeout_s: float = 60.0) -> None:
    """Every live replica's pool passes check_integrity() and is all-free, and the controller
    has no request queued or assigned (waits for stragglers such as aborts still in flight and
    the reports that tell the controller, up to `timeout_s`)."""
    import time

    import ray
    from live_actors import replica_check
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + timeout_s
    for cluster in clusters:
        for rid, handle in cluster.replicas.items():
            while True:
                try:
                    state = replica_check(handle, timeout_s)
                except RayActorError:
                    break  # killed by the test
                if state["all_free"] and state["requests"] == 0:
                    break
                assert time.monotonic() < deadline, f"{rid} not idle: {state}"
                time.sleep(0.1)
        while True:  # and the controller holds nothing for them: no leaked slot or ticket
            stats = ray.get(cluster.controller.stats.remote(), timeout=timeout_s)
            if stats["queued"] == 0 and not any(stats["assigned"].values()):
                break
            assert time.monotonic() < deadline, f"{cluster.name} controller not idle: {stats}"
            time.sleep(0.1)


@pytest.fixture(scope="session")
def sim_expected():
    return sim_tokens


@pytest.fixture(scope="session")
def replica_check():
    return check_replicas


@pytest.fixture(scope="session")
def ray_starter():
    return start_ray


@pytest.fixture(scope="module")
def ray_session(request):
    """Ray for a module of cluster tests with `NUM_GPUS` fake GPUs; afterwards the module's
    `CLUSTERS` are shut down, then Ray."""
    start_ray(request.module.NUM_GPUS)
    yield
    import ray

    for c in request.module.CLUSTERS:
        try:
            c.shutdown()
        except Exception:
            pass
    ray.shutdown()


@pytest.fixture(autouse=True)
def pools_all_free(request):
    """After each test of a module with `CLUSTERS`: every pool all-free, nothing held."""
    yield
    clusters = getattr(request.module, "CLUSTERS", None)
    if clusters is not None:
        check_replicas(clusters)
