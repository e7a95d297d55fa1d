"""Instructions per scheduler step, counted by valgrind: a deterministic A/B of two code trees.

Wall-clock medians on a shared 2-core VM move by +-30% between minutes, so a change of 10% is
invisible in them. Counting instructions (valgrind's cachegrind, no cache simulation) gives the
same number on every run. One step = schedule() + update_from_output() at the benchmark's
state (256 running, 100 tenants, block size 16; 2,000 waiting, which changes only the queue's
heap depth). The count is a difference of whole-process runs:

    (run with K steps) - (run with 0 steps) - K x (runner) - K x (adding a request)

where the runner's and add_request's shares are measured by runs that do them twice. Memory
stalls are not instructions: use this to compare code, and `fairbatch bench scheduler` for time.

    python -m fairbatch.benchmarks.scheduler_instructions --root /path/to/tree --policy fcfs
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

_CHILD = r"""
import gc, importlib.util, random, sys
root, policy, steps, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
spec = importlib.util.spec_from_file_location(
    "fairbatch", f"{root}/__init__.py", submodule_search_locations=[root])
mod = importlib.util.module_from_spec(spec); sys.modules["fairbatch"] = mod
spec.loader.exec_module(mod)
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Request, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner
rng = random.Random(0)
pol = make_policy(policy, [TenantSpec(f"t{i}", weight=1 + i % 4) for i in range(100)])
cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=768, max_model_len=4096)
s = Scheduler(cfg, KVCacheManager(256 * 12 + 64, 16), pol)
runner, n = FakeRunner(32000), [0]
def add():
    n[0] += 1; t = rng.randrange(100)
    prompt = [rng.randrange(32000) for _ in range(64)]
    s.add_request(Request(f"r{n[0]}", prompt, rng.randint(64, 128), tenant=f"t{t}", priority=t % 3))
for _ in range(256 + 2000): add()
while len(s.running) < 256:
    o = s.schedule(); s.update_from_output(o, runner.execute(o))
for _ in range(50):
    o = s.schedule(); u = s.update_from_output(o, runner.execute(o))
    for _ in u.finished: add()
gc.disable()
for _ in range(steps):
    o = s.schedule()
    ro = runner.execute(o)
    if extra == "runner": runner.execute(o)
    u = s.update_from_output(o, ro)
    for _ in u.finished:
        add()
        if extra == "add": add()
"""


def _instructions(root: str, policy: str, steps: int, extra: str) -> int:
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    cmd += [sys.executable, "-c", _CHILD, root, policy, str(steps), extra]
    # A fixed string-hash seed: dict and set layouts (and so the instructions they take) are
    # the same in every run, which makes two trees' counts comparable to a few hundred.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stderr
    match = re.search(r"I\s+refs:\s+([\d,]+)", out)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out[-2000:]}")
    return int(match.group(1).replace(",", ""))


def per_step(root: str, policy: str, steps: int = 200) -> float:
    """Instructions of one schedule() + update_from_output(), runner and intake excluded."""
    base = _instructions(root, policy, 0, "")
    run = _instructions(root, policy, steps, "")
    runner = _instructions(root, policy, steps, "runner") - run
    intake = _instructions(root, policy, steps, "add") - run
    return (run - base - runner - intake) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="a fairbatch source tree (repo root)")
    parser.add_argument("--policy", default="weighted_fair")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind not found (apt-get install valgrind)", file=sys.stderr)
        return 2
    n = per_step(args.root, args.policy, args.steps)
    print(f"{args.policy} {args.root}: {n / 1e3:.0f} k instructions per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
