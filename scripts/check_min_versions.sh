#!/usr/bin/env bash
# Run the test suite at pyproject.toml's minimum versions: install mmgrpo into a virtualenv of its own with each
# floor of `dependencies` and of the `video` and `deepspeed` extras pinned to its release series (`name>=X.Y` becomes
# `name==X.Y.*`; the dev tools stay at their newest), then run pytest there with the given arguments.
#   scripts/check_min_versions.sh                  # the whole suite (pyproject's two workers)
#   scripts/check_min_versions.sh -n 0 tests/vlm   # one folder, in one process
# MMGRPO_MIN_VENV: the virtualenv (default ~/.cache/mmgrpo-min; created if missing, never the dev one).
# MMGRPO_CACHE: the tiny-model cache (default ~/.cache/mmgrpo-min-cache, apart from the usual ~/.cache/mmgrpo:
# a tiny model saved by a newer transformers may not load in an older one). Needs python3 >= 3.11 (tomllib).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${XDG_CACHE_HOME:-$HOME/.cache}"
venv="${MMGRPO_MIN_VENV:-$cache/mmgrpo-min}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"

pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
"$venv/bin/python" - >"$pins" <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for requirement in project["dependencies"] + extras["video"] + extras["deepspeed"]:
    print(re.sub(r">=([0-9.]+)", r"==\1.*", requirement, count=1))
EOF
echo "check_min_versions: pins: $(grep -v '^#' "$pins" | tr '\n' ' ')"
"$venv/bin/pip" install -q -e ".[dev,video]" -r "$pins"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export MMGRPO_CACHE="${MMGRPO_CACHE:-$cache/mmgrpo-min-cache}"
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|torchvision|transformers|diffusers|peft|accelerate) '
exec "$venv/bin/python" -m pytest -q "$@"
