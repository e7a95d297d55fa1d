#!/usr/bin/env bash
# The prepared GPU check: the `gpu` tests, flash vs torch parity, decode step time of a ~1B
# Llama (eager and CUDA graphs) against the bandwidth bound, swap bandwidth against plain
# copies, LLM.generate under swap and recompute preemption, and Qwen3 / Qwen3-MoE against the
# CPU path - one JSON report, at most 8 minutes on one GPU. Usage: bash benchmarks/gpu_check.sh [report.json]
# Exit status: 0 all checks passed, 1 a check failed (see the report), 2 no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
py="${PYTHON:-python}"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to torch ($("$py" -c 'import torch; print(torch.__version__)' 2>&1 | tail -n 1)); nothing was run" >&2
    exit 2
fi
# SIGINT at 470 s lets the helper write what it has; KILL 10 s later keeps us under 8 minutes.
exec timeout --signal=INT --kill-after=10 470 "$py" -m fairbatch.benchmarks.gpu_check --out "$out"
