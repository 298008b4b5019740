#!/usr/bin/env bash
# Separate virtual environment for NVIDIA kvpress 0.5.5, the peer that tests/test_peer.py (`pytest -m peer`) and
# benchmarks/kvpress_side_by_side.py compare our policies with. kvpress 0.5.5 pins transformers<5.3 while
# snapkv_lab runs on transformers 5.23, so kvpress is never a project dependency: it lives in its own venv.
#   default: ${SNAPKV_LAB_CACHE:-~/.cache/snapkv_lab}/kvpress-venv (snapkv_lab's cache folder); KVPRESS_VENV overrides.
# Idempotent and cached: a complete venv is checked in a few seconds and left as it is (CI runs this every time).
set -euo pipefail

VENV="${KVPRESS_VENV:-${SNAPKV_LAB_CACHE:-$HOME/.cache/snapkv_lab}/kvpress-venv}"
PY="${PYTHON:-python3}"
# torch pinned, in the same command as kvpress: a bare `torch` requirement would pull a CUDA build. No model: the
# worker loads the checkpoint snapkv_lab converts the bundled GGUF into (snapkv_lab.models.bundled_checkpoint()).
PINS=("torch==2.13.0" "kvpress==0.5.5" "transformers==5.2.0")

complete() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md
assert md.version("kvpress") == "0.5.5" and md.version("transformers") == "5.2.0"
assert md.version("torch").startswith("2.13.0")
PY
}

if ! complete; then
    [ -x "$VENV/bin/python" ] || { echo "creating $VENV"; mkdir -p "$(dirname "$VENV")"; "$PY" -m venv "$VENV"; }
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q "${PINS[@]}"
    complete || { echo "kvpress venv at $VENV is still incomplete after installing" >&2; exit 1; }
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print(" ".join(f"{name}=={md.version(name)}" for name in ("torch", "transformers", "kvpress")))
PY
echo "kvpress venv ready: $VENV"
