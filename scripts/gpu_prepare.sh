#!/usr/bin/env bash
# Run on the CPU machine (package registries reachable) before a GPU session: puts into .gpu/ (git-ignored; carry it
# to the GPU machine) what scripts/gpu_check.sh installs there, where nothing can be downloaded:
#   - the transformers wheel this checkout is tested with (the GPU image may hold an older one),
#   - mamba-ssm's and causal-conv1d's source distributions (Triton step as is; causal-conv1d compiled for sm_90 there).
#
#   bash scripts/gpu_prepare.sh         versions: TRANSFORMERS_VERSION (default: the installed one),
#                                       MAMBA_SSM_VERSION=2.3.2.post1, CAUSAL_CONV1D_VERSION=1.7.0
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
dest=.gpu
transformers=${TRANSFORMERS_VERSION:-$("$python" -c "import transformers; print(transformers.__version__)")}
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any -d "$dest.tmp" "transformers==$transformers"
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
grep -qx '/.gpu/' .gitignore 2>/dev/null || echo "note: .gpu/ is not in .gitignore"
echo "gpu_prepare: $(ls "$dest" | xargs) ($(du -sh "$dest" | cut -f1)) in $dest/ — carry it: run(carry=[\".gpu\"], ...)"
