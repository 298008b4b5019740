#!/usr/bin/env bash
# GPU readiness in one command: the CUDA tests, then the capture and compression benchmarks on a randomly
# initialised model of Llama-3-8B's shape in bf16, at 8k, 16k and 32k prompt tokens, under sdpa and, where
# flash-attn imports, flash_attention_2. Tables are printed, saved as CSV under benchmarks/results/, and
# collected in benchmarks/results/gpu_check.md. Exits non-zero if a test or a benchmark failed; the rest still runs.
#   bash scripts/gpu_check.sh          (PYTHON=/path/to/python to pick another interpreter)
#
# Budget: one command of under 10 minutes on one H100 (the device tool's limit). Each benchmark row runs in a
# fresh process that builds the 8B model on the GPU (imports and build: about 10-20 s), which costs more than the
# measurement itself. Capture runs --check-exact (sampled blocks in float64 and the first 1024 tokens against an eager
# twin of the same seeded weights). Eager output_attentions runs at the shortest length only once it runs out of
# memory (its maps need about 137 GB at 8k); the longer rows then say so without a model load.
# GPU_CHECK_LENGTHS (default "8192 16384 32768") sets the prompt lengths.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# This checkout's package, whatever an installed copy points at.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: nvidia-smi not found: no NVIDIA driver on this machine, nothing to check." >&2
  exit 1
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA GPU (a CPU build of torch?)." >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

tests=0
"$PY" -m pytest -q -rs -m cuda tests/test_cuda.py || tests=$?

attns=(sdpa)
if "$PY" -c "import flash_attn" 2>/dev/null; then
  attns+=(flash_attention_2)
else
  echo "gpu_check: flash_attn does not import: flash_attention_2 benchmarks skipped." >&2
fi

mkdir -p benchmarks/results
report=benchmarks/results/gpu_check.md
{ echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; } > "$report"
failed=()
bench() {  # a benchmark that crashes is reported at the end; the others still run
  "$PY" "$@" | tee -a "$report" || failed+=("$*")
}
read -ra lengths <<< "${GPU_CHECK_LENGTHS:-8192 16384 32768}"
model=(--device cuda --dtype bf16 --shape llama3-8b --lengths "${lengths[@]}" --new-tokens 64)
for attn in "${attns[@]}"; do
  modes=(generate capture)
  [[ $attn == sdpa ]] && modes+=(eager)
  bench benchmarks/bench_compression.py "${model[@]}" --attn "$attn" --repeats 2
  bench benchmarks/bench_capture.py "${model[@]}" --attn "$attn" --modes "${modes[@]}" --check-exact
done

echo "gpu_check: tables in $report and benchmarks/results/*.csv"
[[ $tests == 0 ]] || echo "gpu_check: CUDA tests failed (pytest exit status $tests)" >&2
for run in "${failed[@]}"; do echo "gpu_check: benchmark failed: $run" >&2; done
[[ $tests == 0 && ${#failed[@]} == 0 ]]
