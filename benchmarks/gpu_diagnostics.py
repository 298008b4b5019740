"""Two readings on a CUDA GPU that explain scripts/gpu_check.sh's tables (docs/performance.md, "GPU").

    python benchmarks/gpu_diagnostics.py                      # random Llama-3-8B-shape model, bf16, sdpa

1. Cold vs warm decode: `generate` twice on the same 8192-token prompt, full cache, SnapKV, PyramidKV and AdaKV at
   25%, with sdpa's cuDNN backend on and off. The first run meets new (query, key) lengths, for which cuDNN builds
   plans; the second reuses them.
2. Backend rounding by depth: plain `model.generate` vs `snapkv_lab.capture` (same weights, same sdpa) on 2048
   tokens: where their greedy tokens first part and the top-2 logit gap there; then, per layer, the trace's maps
   of the first 512 tokens vs eager `output_attentions` of the same weights. Both backends see the same inputs
   only at layer 0; every later layer inherits each backend's bf16 rounding of the layers before it.
"""

from __future__ import annotations

import argparse

import torch
from _common import RANDOM_SHAPES, IdTokenizer
from transformers import AutoModelForCausalLM, LlamaConfig

from snapkv_lab import POLICIES, capture, generate


def cold_and_warm_decode(model, length: int) -> None:
    ids = torch.randint(model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for name in ("FullCache", "SnapKV", "PyramidKV", "AdaKV"):
            policy = POLICIES[name]() if name == "FullCache" else POLICIES[name](capacity=0.25)
            runs = [generate(model, IdTokenizer(), ids.cuda(), policy=policy, max_new_tokens=16) for _ in range(2)]
            print(f"cudnn_sdp={cudnn} {name}: decode ms/token, first and second run "
                  f"{[round(r.decode_ms_per_token, 1) for r in runs]}, prefill {runs[-1].prefill_seconds:.2f} s", flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)


def top2_gaps(scores) -> list[float]:
    """Per greedy step, the gap between the two largest logits: near 0, any rounding can flip the token."""
    return [float(top[0] - top[1]) for top in (step[0].float().topk(2).values for step in scores)]


def rounding_by_depth(model, length: int, prefix: int) -> None:
    ids = torch.randint(model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.inference_mode():
        plain = model.generate(ids.cuda(), max_new_tokens=16, do_sample=False, output_scores=True,
                               return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    trace = capture(model, IdTokenizer(), ids, max_new_tokens=16, stop_at_eos=False, progress=False, store_device=None)
    theirs, ours = plain.sequences[0, length:].cpu(), trace.token_ids[length:].cpu()
    parted = (theirs != ours).nonzero()
    print(f"capture vs model.generate: tokens part at new token {int(parted[0]) if len(parted) else None}; "
          f"model.generate's top-2 logit gap per step {[round(float(g), 4) for g in top2_gaps(plain.scores)]}")
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        maps = model(ids[:, :prefix].cuda(), output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    for layer in sorted({0, 1, 2, 4, 8, 16, len(maps) - 1}):
        diff = (trace.attention(layer, queries=slice(0, prefix), keys=slice(0, prefix)).cpu()
                - maps[layer][0].float().cpu()).abs().max()
        print(f"layer {layer}: max |trace - eager bf16| over the first {prefix} tokens {float(diff):.4g}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(RANDOM_SHAPES), default="llama3-8b")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM_SHAPES[args.shape]), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    cold_and_warm_decode(model, 8192)
    rounding_by_depth(model, 2048, 512)


if __name__ == "__main__":
    main()
