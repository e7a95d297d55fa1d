"""`ray up` for real on loopback: deployments/ray_up_local.sh (sshd on 127.0.0.1, the
local-provider cluster config, `serve deploy`, one HTTP request, `ray down`).

It installs packages and runs sshd on port 22, so it runs only when asked: CI sets
FAIRBATCH_RAY_UP=1. About 80 s (15 s more when it must apt-get openssh-server and rsync).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deployments" / "ray_up_local.sh"
LIMIT_S = 300  # the script bounds itself at this; the extra minute is for its cleanup


@pytest.mark.skipif(
    os.environ.get("FAIRBATCH_RAY_UP") != "1",
    reason="set FAIRBATCH_RAY_UP=1 to run ray up on loopback (needs root: apt-get, sshd on :22)",
)
def test_ray_up_local_serves_a_request_and_cleans_up():
    env = dict(os.environ, FAIRBATCH_RAY_UP_TIMEOUT=str(LIMIT_S))
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # (conftest's): a second node joins
    env.pop("_FB_RAY_UP_INNER", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=LIMIT_S + 90
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "answered a completion" in out and '"completion_tokens":8' in out
    work = [line for line in out.splitlines() if "/tmp/fbup-" in line]
    leftovers = subprocess.run(["pgrep", "-f", "/tmp/fbup-"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", (leftovers.stdout, work)
