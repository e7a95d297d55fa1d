"""`python reaper.py [--pass-fd N ...] -- CMD ...`: run CMD and take down its whole session
when the benchmark that started it dies.

The benchmark starts each peer (vLLM's offline script, `vllm serve`, `fairbatch serve`) as this
process, in a session of its own, and kills that session when it is done with it. A benchmark
killed outright (SIGKILL, the OOM killer) runs no cleanup, and vLLM's engine processes would
keep the cores; so on Linux this process asks the kernel for a SIGTERM when its parent dies
(PR_SET_PDEATHSIG) and answers it by killing its process group: CMD and every process CMD
started. SIGINT is passed on to CMD (a server's clean shutdown). Standard library only: it runs
before anything else is imported.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _kill_group(*_: object) -> None:
    os.killpg(0, signal.SIGKILL)  # this process too


def main(argv: list[str]) -> int:
    fds: list[int] = []
    while argv and argv[0] == "--pass-fd":
        fds.append(int(argv[1]))
        argv = argv[2:]
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: reaper.py [--pass-fd N ...] -- CMD ...", file=sys.stderr)
        return 2
    cmd = argv[1:]
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _kill_group)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        _kill_group()
    # SIGINT is passed on. Handled here (not ignored, as it is when a shell started the
    # benchmark in the background), it starts CMD with its default action: a Python server
    # then gets its KeyboardInterrupt, instead of ignoring the signal until SIGKILL.
    started: list[subprocess.Popen] = []
    signal.signal(signal.SIGINT, lambda *_: [p.send_signal(signal.SIGINT) for p in started])
    proc = subprocess.Popen(cmd, pass_fds=fds)
    started.append(proc)
    for fd in fds:  # (the child holds them now: a reader sees EOF when the child exits)
        os.close(fd)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
