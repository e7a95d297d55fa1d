"""Placement counts a replica's host-tier prefixes as hits: a tagged report (report_hashes)
indexes them, and d2lpm ranks a device match above an equally long host one, and a host match
above recomputing on a replica without the prefix."""

import random

from fairbatch.deployments.cluster.placement import Placement, report_hashes, split_hashes
from fairbatch.deployments.cluster.tickets import Ticket
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.kv.block_pool import hash_block

PROMPT = list(range(1, 65))  # four blocks of 16


def chain(tokens: list[int], salt: str) -> list[bytes]:
    hashes, parent = [], None
    for i in range(len(tokens) // 16):
        parent = hash_block(parent, tokens[i * 16 : (i + 1) * 16], salt)
        hashes.append(parent)
    return hashes


def ticket(rid: str) -> Ticket:
    meta = RequestMeta(
        rid, PROMPT + [7], SamplingParams(max_tokens=4), "t", cache_salt="t",
        prefix_hashes=chain(PROMPT, "t"),
    )  # fmt: skip
    return Ticket(meta, rid, "t", 0)


def placement(reports: dict[str, list[bytes]]) -> Placement:
    p = Placement("d2lpm", random.Random(0))
    for rid, hashes in reports.items():
        r = p.add(rid, seats=4)
        p.set_hashes(r, hashes)
    return p


def test_report_hashes_round_trips_and_a_block_on_both_is_a_device_hit():
    h = chain(PROMPT, "t")
    reported = report_hashes(h[:2], h[1:])
    assert len(reported) == 4  # h[1] once, untagged
    assert split_hashes(reported) == (set(h[:2]), set(h[2:]))


def test_d2lpm_prefers_device_then_host_then_nothing():
    h = chain(PROMPT, "t")
    reports = {
        "none": [],
        "host": report_hashes([], h),  # the whole prefix in its host tier
        "device": report_hashes(h, []),
    }
    assert placement(reports).pick(ticket("a")).replica_id == "device"
    del reports["device"]
    assert placement(reports).pick(ticket("b")).replica_id == "host"
    # more blocks on the host beat fewer on the device (0.8 x 4 > 3)
    reports["device"] = report_hashes(h[:3], [])
    assert placement(reports).pick(ticket("c")).replica_id == "host"
    # another salt's host blocks are no match: the least loaded takes it, for no locality
    t = ticket("d")
    assert placement({"u": report_hashes([], chain(PROMPT, "u"))}).pick(t).replica_id == "u"
    assert t.locality == 0.0
    t = ticket("e")
    assert placement({"t": report_hashes([], h)}).pick(t).replica_id == "t"
    assert t.locality > 0.0  # placed for its host-tier match
