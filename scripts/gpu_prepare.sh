#!/usr/bin/env bash
# Run on the CPU machine (package registries reachable) before a GPU session: puts into .gpu/ (git-ignored; carry it
# to the GPU machine) what scripts/gpu_check.sh installs there, where nothing can be downloaded:
#   - the transformers and gguf wheels this checkout is tested with (the GPU image may hold an older transformers,
#     and no gguf),
#   - mamba-ssm's and causal-conv1d's source distributions (Triton step as is; causal-conv1d compiled for sm_90 there),
#   - with TARGET=1, the shipped target for scripts/gpu_make_data.sh: its 98 MB GGUF xz-compressed and cut in two,
#     .gpu-target-a/ and .gpu-target-b/, since one call carries at most 64 MiB with the checkout: carry
#     .gpu-target-a alone in one call, then .gpu and .gpu-target-b in the next (the machine keeps the first).
#
#   bash scripts/gpu_prepare.sh         versions: TRANSFORMERS_VERSION, GGUF_VERSION (default: the installed ones),
#                                       MAMBA_SSM_VERSION=2.3.2.post1, CAUSAL_CONV1D_VERSION=1.7.0
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
dest=.gpu
transformers=${TRANSFORMERS_VERSION:-$("$python" -c "import transformers; print(transformers.__version__)")}
gguf=${GGUF_VERSION:-$("$python" -c "from importlib.metadata import version; print(version('gguf'))")}
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any -d "$dest.tmp" "transformers==$transformers" "gguf==$gguf"
# sdists from PyPI's simple index (pip download would build their metadata, which needs CUDA), digest-checked
"$python" - "$dest.tmp" "mamba-ssm==${MAMBA_SSM_VERSION:-2.3.2.post1}" "causal-conv1d==${CAUSAL_CONV1D_VERSION:-1.7.0}" <<'PY'
import hashlib, json, sys, urllib.request
from pathlib import Path

dest = Path(sys.argv[1])
for spec in sys.argv[2:]:
    name, version = spec.split("==")
    index = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(index, timeout=60) as r:
        wanted = f"{name.replace('-', '_')}-{version}.tar.gz"
        files = [f for f in json.load(r)["files"] if f["filename"] == wanted]
    if not files:
        sys.exit(f"gpu_prepare: no {wanted} on PyPI")
    with urllib.request.urlopen(files[0]["url"], timeout=120) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != files[0]["hashes"]["sha256"]:
        sys.exit(f"gpu_prepare: {wanted}: sha256 mismatch")
    (dest / wanted).write_bytes(data)
PY
rm -rf "$dest" && mv "$dest.tmp" "$dest"
if [[ ${TARGET:-0} == 1 ]]; then
    gguf_file=$("$python" -c "from mamba_draft.targets import shipped_target; print(shipped_target())")
    rm -rf .gpu-target-a .gpu-target-b && mkdir -p .gpu-target-a .gpu-target-b
    sha256sum "$gguf_file" | cut -d' ' -f1 >.gpu-target-b/sha256
    basename "$gguf_file" >.gpu-target-b/name
    xz -9 -T2 -c "$gguf_file" | split -b 52000000 -d -a 1 - .gpu-target-x.
    mv .gpu-target-x.0 .gpu-target-a/part && mv .gpu-target-x.1 .gpu-target-b/part
    echo "gpu_prepare: target in .gpu-target-a ($(du -sh .gpu-target-a | cut -f1)) and .gpu-target-b ($(du -sh .gpu-target-b | cut -f1))"
fi
grep -qx '/.gpu/' .gitignore 2>/dev/null || echo "note: .gpu/ is not in .gitignore"
echo "gpu_prepare: $(ls "$dest" | xargs) ($(du -sh "$dest" | cut -f1)) in $dest/ — carry it: run(carry=[\".gpu\"], ...)"
