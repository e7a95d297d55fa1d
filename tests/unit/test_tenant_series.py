"""Per-tenant metric series stay bounded: the controller exports the tenants the app's config
names, so a tenant removed from the config (a redeploy over a running cluster) is no longer
set, and its series ages out of Ray's metrics agent."""

from __future__ import annotations

import asyncio

from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.managed import ClusterController
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine.sampling_params import SamplingParams


def test_a_tenant_removed_from_the_config_stops_being_exported():
    controller = ClusterController(ControllerConfig(), metrics_interval_s=0)
    core = controller.core
    for rid, tenant in (("r1", "kept"), ("r2", "removed")):
        core.submit(RequestMeta(rid, [1, 2, 3], SamplingParams(max_tokens=4), tenant=tenant))
    assert set(controller.exported(core.counters())) == {"kept", "removed"}  # not told yet
    asyncio.run(controller.set_tenants(["kept", "new"]))  # the redeployed app's tenants
    assert set(controller.exported(core.counters())) == {"kept"}
    assert set(controller.exported(core.policy.service())) <= {"kept"}
    assert set(core.counters()) >= {"kept", "removed"}  # its queue still serves both
