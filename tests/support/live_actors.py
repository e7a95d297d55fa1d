"""The actors of a served app that are alive now, found by name (tests that kill them)."""

from __future__ import annotations


def live_replicas(prefix: str) -> dict:
    """Name -> handle of the cluster's replica actors (`<cluster id>-r<i>`, `...~<hex>` for a
    replacement) that answer a ping now: not what the controller believes."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from fairbatch.deployments.cluster.launch import NAMESPACE

    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] != NAMESPACE or not a["name"].startswith(prefix):
            continue
        try:
            h = ray.get_actor(a["name"], namespace=NAMESPACE)
            ray.get(h.ping.remote(), timeout=30)
        except (ValueError, RayActorError, GetTimeoutError):
            continue  # killed, or dying
        out[a["name"]] = h
    return out


# Test-only looks inside live actors go through Ray's `__ray_call__` (a function run on the
# actor, in a thread of its own): the actors carry no method that only tests call. This module
# is not importable in Ray's workers, so cloudpickle ships its functions by value.


def _by_value() -> None:
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def replica_check(handle, timeout_s: float = 30.0) -> dict:
    """On the replica's engine thread, between steps: its pools pass check_integrity() (raises
    if not), whether every block is free again and how many requests its scheduler holds."""
    import ray

    _by_value()

    def check(replica) -> dict:
        core = replica.core

        def run() -> dict:
            core.check_integrity()
            s = core.scheduler
            return {"all_free": s.kv.all_free(), "requests": len(s.requests)}

        return _on_loop(replica.engine._loop, replica.engine.call(run), timeout_s, run)

    return ray.get(handle.__ray_call__.remote(check), timeout=timeout_s + 5)


def migrate(controller, request_id: str, dst_id: str | None = None, timeout_s: float = 60.0):
    """Have the controller move a request to another replica (`dst_id`, or its choice), as it
    moves a displaced one: an ObjectRef of the destination's id, or of None when it could not."""

    _by_value()

    def move(c):
        async def go():
            action = c.core.migrate(request_id, dst_id)
            if action is None:
                return None
            return action.dst if await c._migrate(action) else None

        # (its watchdog task, started by the first call, knows the actor's loop)
        return _on_loop(c._watchdog.get_loop(), go(), timeout_s)

    return controller.__ray_call__.remote(move)


def _on_loop(loop, coro, timeout_s: float, idle=None):
    """Run `coro` on the actor's event loop from `__ray_call__`'s thread and wait for it. With
    no loop yet (nothing async ever ran there, so no engine step either): `idle()` here."""
    import asyncio

    if loop is None:
        coro.close()
        return idle()
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)
