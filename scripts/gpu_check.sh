#!/usr/bin/env bash
# GPU readiness in one command: the CUDA tests, then the capture and compression benchmarks on a randomly
# initialised model of Llama-3-8B's shape in bf16, at 8k, 16k and 32k prompt tokens, under sdpa and, where
# flash-attn imports, flash_attention_2. Tables are printed, saved as CSV under benchmarks/results/, and
# collected in benchmarks/results/gpu_check.md. Exits non-zero if a test or a benchmark failed; the rest still runs.
#   bash scripts/gpu_check.sh          (PYTHON=/path/to/python to pick another interpreter)
#
# Budget: about 20 minutes on one H100. 64 new tokens per run and 2 repeats (as on CPU) are estimated from the
# model's arithmetic, not yet measured: 16 GB of bf16 weights put a 32k prefill at a few seconds and a decode
# step at tens of milliseconds, so each benchmark process spends more time starting (imports, building the
# model on the GPU, about 10-20 s) than measuring. 15 capture processes (eager output_attentions only once, under
# sdpa: it is the same run whatever the backend; it runs out of memory from 8k on, reported as a row) and 2
# compression processes come to roughly 10 minutes.
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
"$PY" -m pytest -q -rs -m cuda || tests=$?

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
model=(--device cuda --dtype bf16 --shape llama3-8b --lengths 8192 16384 32768 --new-tokens 64)
for attn in "${attns[@]}"; do
  modes=(generate capture)
  [[ $attn == sdpa ]] && modes+=(eager)
  bench benchmarks/bench_capture.py "${model[@]}" --attn "$attn" --modes "${modes[@]}"
  bench benchmarks/bench_compression.py "${model[@]}" --attn "$attn" --repeats 2
done

echo "gpu_check: tables in $report and benchmarks/results/*.csv"
[[ $tests == 0 ]] || echo "gpu_check: CUDA tests failed (pytest exit status $tests)" >&2
for run in "${failed[@]}"; do echo "gpu_check: benchmark failed: $run" >&2; done
[[ $tests == 0 && ${#failed[@]} == 0 ]]
