#!/usr/bin/env bash
# The suite under every CPU kernel path we can force on one machine: the defaults, MKL held to AVX2, ATen's
# vector kernels narrowed to AVX2 and to the scalar default, and oneDNN held to narrower ISAs. A test that only passes on one kernel path compares
# results exactness does not promise; this is how to find it without owning every CPU.
#
#   bash scripts/kernel_sweep.sh [pytest args...]     e.g. bash scripts/kernel_sweep.sh tests/test_lossy_rules.py
#
# Prints the CPU, what it supports, and one summary line per setting; logs go to ${SWEEP_LOGS:-/tmp/kernel-sweep}.
# Runs one setting at a time (two suites on the same cores would only measure contention). Exit 1 if any failed.
# The one test that compiles (torch.compile) keeps its own inductor cache: PyTorch's on-disk cache is not keyed on
# ATEN_CPU_CAPABILITY, and a kernel compiled under another setting segfaults when loaded. (Setting
# TORCHINDUCTOR_CACHE_DIR for the whole run instead made launched DeepSpeed ranks die at exit in std::terminate.)
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
logs=${SWEEP_LOGS:-/tmp/kernel-sweep}
mkdir -p "$logs"

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) ($(nproc) cores)"
echo "supports: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | xargs)"
# oneDNN held below AMX (AVX512_CORE_BF16), below native bf16 (AVX512_CORE: bf16 emulated) and to AVX2 (no bf16
# kernels, so no layer is prepacked); a machine cannot force a path its CPU lacks (AMX on an AMD EPYC):
# tests/test_invariance.py's adversarial kernel stands in for those.
settings=("defaults" "MKL_ENABLE_INSTRUCTIONS=AVX2" "ATEN_CPU_CAPABILITY=avx2" "ATEN_CPU_CAPABILITY=default"
          "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" "ONEDNN_MAX_CPU_ISA=AVX512_CORE" "ONEDNN_MAX_CPU_ISA=AVX2")
status=0
for setting in "${settings[@]}"; do
    env_args=()
    [[ $setting == defaults ]] || env_args=("$setting")
    capability=$(env "${env_args[@]}" "$python" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
    log="$logs/${setting//[^A-Za-z0-9_]/_}.log"
    start=$SECONDS
    env "${env_args[@]}" "$python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
    code=$?
    echo "$setting (ATen capability $capability): $(tail -n 1 "$log") [exit $code, $((SECONDS - start)) s, $log]"
    [[ $code == 0 ]] || status=1
done
exit $status
