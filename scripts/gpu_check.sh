#!/usr/bin/env bash
# On a GPU machine (H100/H200; nothing downloadable there), from a clean checkout with .gpu/ carried
# (scripts/gpu_prepare.sh makes it): install what is missing, build causal-conv1d for this GPU's architecture only,
# run tests/test_gpu.py, then the timings (mamba_draft/benchmarks/gpu_timings.py). Writes under OUT_DIR (a call returns at
# most 8 files): check.log (GPU, versions, kernels, the build's tail if it failed, tests, timings),
# gpu_timings.{json,md} and two plots.
#
#   bash scripts/gpu_check.sh OUT_DIR        env: SKIP_KERNELS=1 (no causal-conv1d build), BUILD_TIMEOUT=420 (s),
#                                            TIMINGS_ARGS="--targets pythia-6.9b" (passed to gpu-timings),
#                                            WHILE_BUILDING="command" (GPU work run while the CPUs compile, before
#                                            the tests, e.g. bash scripts/gpu_make_data.sh OUT_DIR 200 ...)
# Well inside one 10-minute call: the kernel build is capped at BUILD_TIMEOUT, and without it the tests and
# timings still run (the torch step only; check.log says so).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
python=${PYTHON:-python3}
site=/tmp/mamba-draft-site
rm -rf "$site" && mkdir -p "$site"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS

# 1. carried wheels (transformers at the version this checkout is tested with)
if compgen -G ".gpu/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/*.whl || exit 1
fi
# 2. mamba-ssm: its Triton step needs no build (mamba_draft.kernels loads it past the package's compiled imports);
#    causal-conv1d: the Python package, and its extension compiled for this GPU alone (the wheel build targets ~10)
for sdist in .gpu/mamba_ssm-*.tar.gz .gpu/causal_conv1d-*.tar.gz; do
    [[ -f $sdist ]] && tar xzf "$sdist" -C /tmp
done
for src in /tmp/mamba_ssm-*/mamba_ssm /tmp/causal_conv1d-*/causal_conv1d; do
    [[ -d $src ]] && cp -r "$src" "$site/"
done
conv_src=$(ls -d /tmp/causal_conv1d-*/csrc 2>/dev/null | head -1)
if [[ ${SKIP_KERNELS:-0} != 1 && -n $conv_src ]]; then
    arch=$("$python" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-$(nproc)} timeout "${BUILD_TIMEOUT:-420}" "$python" - "$conv_src" "$site" \
        >/tmp/causal_conv1d_build.log 2>&1 <<'PY' &
import shutil, sys, time
from pathlib import Path
from torch.utils.cpp_extension import load

csrc, site = Path(sys.argv[1]), Path(sys.argv[2])
build = Path("/tmp/causal_conv1d_build")
build.mkdir(exist_ok=True)
started = time.time()
module = load(name="causal_conv1d_cuda", build_directory=str(build), verbose=True,
              sources=[str(csrc / n) for n in ("causal_conv1d.cpp", "causal_conv1d_fwd.cu", "causal_conv1d_bwd.cu",
                                              "causal_conv1d_update.cu")],
              extra_include_paths=[str(csrc)], extra_cflags=["-O3"],
              extra_cuda_cflags=["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                                 "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                                 "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
                                 "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math"])
shutil.copy2(module.__file__, site / Path(module.__file__).name)
print(f"built causal_conv1d_cuda in {time.time() - started:.0f} s")
PY
    build=$!
fi
if [[ -n ${WHILE_BUILDING:-} ]]; then
    bash -c "$WHILE_BUILDING"
    echo "while building: exit $? after $((SECONDS - start)) s"
fi
log="$out/check.log"
if [[ -n ${build:-} ]]; then
    wait "$build"
    code=$?
    echo "kernel build: exit $code after $((SECONDS - start)) s" | tee "$log"
    [[ $code == 0 ]] || tail -n 30 /tmp/causal_conv1d_build.log >>"$log"
fi
{
    nvidia-smi -L
    "$python" -c "import torch, transformers, mamba_draft; print('torch', torch.__version__, '| CUDA', torch.version.cuda, \
'|', torch.cuda.get_device_name(), '| transformers', transformers.__version__, '| kernels', mamba_draft.kernels_available())"
} 2>&1 | tee -a "$log"

# 3. the GPU tests, then 4. the timings
status=0
"$python" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee -a "$log" | tail -n 15
[[ ${PIPESTATUS[0]} == 0 ]] || status=1
echo "tests done after $((SECONDS - start)) s"
# shellcheck disable=SC2086
"$python" -m mamba_draft.commands.cli gpu-timings --out "$out" ${TIMINGS_ARGS:-} 2>&1 | tee -a "$log" | tail -n 60
[[ ${PIPESTATUS[0]} == 0 ]] || status=1
echo "gpu_check: exit $status after $((SECONDS - start)) s; results in $out"
exit $status
