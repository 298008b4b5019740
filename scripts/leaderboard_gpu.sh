#!/usr/bin/env bash
# kvpress's public leaderboard protocol, run through the lab's `snapkv-lab eval`: RULER at 4096 tokens, compression
# ratios 0.25 0.5 0.75 0.875, both modes (kvpress's default compresses the context alone; its --query_aware loop
# compresses the question with it), every lab policy, the full cache once; then kvpress's results files
# (`--export kvpress`: one folder per policy x ratio x mode, config.yaml, metrics.json, predictions.csv) and the
# leaderboard figure. kvpress's own script: NVIDIA/kvpress evaluation/leaderboard.sh (8bb29b9), Qwen/Qwen3-8B.
#
#   bash scripts/leaderboard_gpu.sh [--model ID] [--out DIR] [--limit N] [--tasks TASK ...] [--policies POLICY ...]
#                                   [--skip POLICY ...] [--random SHAPE] [--length TOKENS] [--dataset ruler-hub]
#                                   [--import DIR ...]
#
#   --model     hub id or folder (default Qwen/Qwen3-8B; on a machine without the Hub, a folder holding it)
#   --out       everything goes here (default runs/leaderboard): data/ (tables, cells), kvpress/ (kvpress's files)
#   --limit     examples per task (default: eval's, each generated task's 10); --tasks: RULER's (default its 13;
#               qa_1 and qa_2 read SQuAD and HotpotQA from the Hub); --policies: as eval takes them (default all:
#               every registered compressor); --skip: policies left out
#   --random    random weights of a shape instead of --model, for time and memory on a GPU: qwen3-8b (Qwen3-8B's
#               layers, heads and widths) or tiny (the same layout at toy size, for CI); built once in
#               OUT/model-SHAPE with the bundled SmolLM2 tokenizer's vocabulary (no download) and read back by a
#               rerun. Scores are noise. tiny's output layer is zero and its id 0 an end token, so that each answer
#               is one token: CI runs the protocol (every policy, ratio and mode, the files), not long decoding.
#               HeadKV, DuoAttention and DuoAllocation rank heads by retrieval scores that
#               random weights cannot earn (they refuse them): skipped under --random.
#   --dataset   ruler (default: RULER generated here, offline) or ruler-hub (kvpress's own rows, simonjegou/ruler,
#               from the Hub: the leaderboard's very examples)
#   --import    kvpress's published results folders, drawn beside the lab's points in the leaderboard figure
#
# Progress: eval's bar counts examples (cells) done, skipped and remaining; each example's answers have a bar of their
# own. Resume: rerun the same command; the examples already stored in OUT/data are skipped, so a run cut short (a
# lease ending) loses at most the example in progress.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package

model=Qwen/Qwen3-8B out=runs/leaderboard limit=() tasks=() chosen=() skip=() random="" length=4096 imports=() dataset=ruler
list=""
while (($#)); do
  case $1 in
    --model) model=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --limit) limit=(--limit "$2"); shift 2 ;;
    --random) random=$2; shift 2 ;;
    --length) length=$2; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --tasks|--policies|--skip|--import) list=$1; shift ;;
    --*) echo "leaderboard_gpu: unknown option $1 (see the head of $0)" >&2; exit 2 ;;
    *) case $list in
         --tasks) tasks+=("$1") ;;
         --policies) chosen+=("$1") ;;
         --skip) skip+=("$1") ;;
         --import) imports+=(--import "$1") ;;
         *) echo "leaderboard_gpu: $1: a value without its option" >&2; exit 2 ;;
       esac
       shift ;;
  esac
  [[ ${1:-} == --* ]] && list=""
done
[[ ${#tasks[@]} -gt 0 ]] && tasks=(--tasks "${tasks[@]}")
mkdir -p "$out"

if [[ -n $random ]]; then
  skip+=(HeadKV DuoAttention DuoAllocation)
  model=$("$PY" - "$random" "$out/model-$random" <<'EOF'
"""A folder of random weights of the shape named, the bundled SmolLM2 tokenizer beside them (read back if there)."""
import json
import sys
from pathlib import Path

# Qwen/Qwen3-8B's config.json: 36 layers, 32 query heads on 8 KV heads of 128 dims, hidden 4096, MLP 12288.
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPES = {"qwen3-8b": QWEN3_8B,
          "tiny": dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16)}
shape, folder = sys.argv[1], Path(sys.argv[2])
if shape not in SHAPES:
    sys.exit(f"leaderboard_gpu: --random {shape}: the shapes are {', '.join(SHAPES)}")

import torch  # noqa: E402 (a misspelt shape is said before the imports' seconds)
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from snapkv_lab.core.models import load_tokenizer  # noqa: E402

tokenizer = load_tokenizer(None)
settings = dict(SHAPES[shape], vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
saved = folder / "config.json"
if saved.exists():
    shape_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim")
    differ = {k for k in shape_keys if json.loads(saved.read_text()).get(k) != settings[k]}
    if differ:
        sys.exit(f"leaderboard_gpu: {folder} holds another shape (differing: {sorted(differ)}); remove it")
else:
    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    with torch.device("cuda" if gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**settings),
                                                 dtype=torch.bfloat16 if gpu else torch.float32)
    if shape == "tiny":  # a zero output layer: greedy picks id 0, made an end token, so every answer is one token
        model.lm_head.weight.data.zero_()
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, 0]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
print(folder)
EOF
  )
  echo "leaderboard_gpu: random $random-shape Qwen3 in $model (scores are noise); skipped: ${skip[*]}" >&2
fi

# the policies chosen (every registered compressor by default) but the skipped ones, by the names eval takes
mapfile -t policies < <("$PY" - "${#skip[@]}" "${skip[@]}" "${chosen[@]:-all}" <<'EOF'
import sys

from snapkv_lab.policies import expand_policies

skipped = int(sys.argv[1])
skip, chosen = sys.argv[2:2 + skipped], sys.argv[2 + skipped:]
print("\n".join(name for name in expand_policies(chosen) if name not in skip))
EOF
)
if [[ ${#policies[@]} -eq 0 ]]; then
  echo "leaderboard_gpu: no policy left to run (--policies ${chosen[*]:-all}, --skip ${skip[*]:-nothing})" >&2
  exit 2
fi
echo "leaderboard_gpu: $model, $dataset at $length tokens, ratios 0.25 0.5 0.75 0.875, both modes, ${#policies[@]} policies" \
     "and the full cache; tables in $out/data, kvpress's files in $out/kvpress" >&2
"$PY" -m snapkv_lab eval --model "$model" --dataset "$dataset" "${tasks[@]}" --lengths "$length" "${limit[@]}" \
  --ratios 0.25 0.5 0.75 0.875 --modes query-agnostic query-aware --policies "${policies[@]}" \
  --data-dir "$out/data" --name leaderboard --export kvpress "$out/kvpress" "${imports[@]}"
