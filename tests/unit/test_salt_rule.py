"""The engine salts a request's cached blocks by its model's rule (`CausalLM.cache_salt_rule`,
here a stand-in with no model): decided for the whole sequence when a request is built, and a
request the rule re-salts as it grows is recomputed under the new salt, once."""

import functools

from fairbatch.engine.core import EngineCore
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import make_policy
from fairbatch.scheduler import Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner
from tests.unit.test_scheduler import VOCAB, reference_tokens

LONG_FROM = 10  # past this many tokens a sequence is "long"


def long_salt(long_from: int, num_tokens: int, salt: str) -> str:  # as a family's rule is
    return f"{salt}:long" if num_tokens > long_from else salt


def test_a_sequence_is_salted_by_its_length_and_recomputed_once_when_it_changes():
    kv = KVCacheManager(32, 4, 0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=64), kv, make_policy("fcfs", ()))
    engine = EngineCore(sched, FakeRunner(VOCAB), salt_rule=functools.partial(long_salt, LONG_FROM))
    prompts = {"long": list(range(1, 13)), "crosses": list(range(1, 7)), "short": [1, 2, 3]}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=rid, tenant="t")
    assert {r: sched.requests[r].cache_salt for r in prompts} == {
        "long": "t:long", "crosses": "t", "short": "t"
    }  # fmt: skip
    salts, tokens = {}, {r: [] for r in prompts}
    while sched.has_unfinished:
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
        salts.update({r: q.cache_salt for r, q in sched.requests.items()})
    assert tokens == {r: reference_tokens(p, 8) for r, p in prompts.items()}
    assert salts == {"long": "t:long", "crosses": "t:long", "short": "t"}
    assert sched.num_preemptions["recompute"] == 1  # "crosses", past 10 tokens
    # rebuilt elsewhere with its output so far: salted for the whole sequence
    rebuilt = engine.make_request(prompts["short"], params, tenant="t", output_ids=[5] * 8)
    assert rebuilt.cache_salt == "t:long"
    engine.check_integrity()
