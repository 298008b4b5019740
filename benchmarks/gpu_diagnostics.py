"""Two readings on a CUDA GPU that explain scripts/gpu_check.sh's tables (docs/performance.md, "GPU").

    python benchmarks/gpu_diagnostics.py                      # random Llama-3-8B-shape model, bf16, sdpa
    python benchmarks/gpu_diagnostics.py --readings decode --policies FullCache PyramidKV

1. Cold vs warm decode by sdpa backend: `generate` twice on the same ~8192-token prompt, full cache, SnapKV,
   PyramidKV and AdaKV at 25%, under torch's default choice, cuDNN, flash, memory-efficient attention alone, and
   all but cuDNN. The first run meets new (query, key) lengths, for which cuDNN builds plans; the second reuses them.
2. Backend rounding by depth: plain `model.generate` vs `snapkv_lab.capture` (same weights, same sdpa) on 2048
   tokens: where their greedy tokens first part and the top-2 logit gap there; then, per layer, the trace's maps
   of the first 512 tokens vs eager `output_attentions` of the same weights. Both backends see the same inputs
   only at layer 0; every later layer inherits each backend's bf16 rounding of the layers before it.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
from _common import RANDOM_SHAPES, IdTokenizer
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, LlamaConfig

from snapkv_lab import POLICIES, capture, generate

# sdpa's backends, each run alone (the default lets torch choose: cuDNN for bf16 on an H100 with torch 2.11).
BACKENDS = {
    "default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "all but cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def cold_and_warm_decode(model, length: int, policies: list[str]) -> None:
    """`generate` twice per backend and policy, 16 new tokens. Each backend gets its own prompt length (length +
    64 i), so that its first run meets (query, key) lengths that no backend met before: cold for cuDNN's plans."""
    for i, (backend, choice) in enumerate(BACKENDS.items()):
        ids = torch.randint(model.config.vocab_size, (1, length + 64 * i), generator=torch.Generator().manual_seed(i))
        for name in policies:
            policy = POLICIES[name]() if name == "FullCache" else POLICIES[name](capacity=0.25)
            try:
                with sdpa_kernel(choice) if choice else nullcontext():
                    runs = [generate(model, IdTokenizer(), ids.cuda(), policy=policy, max_new_tokens=16)
                            for _ in range(2)]
            except RuntimeError as err:  # a backend that cannot run these shapes
                print(f"backend={backend} {name}: failed: {str(err).splitlines()[0][:200]}", flush=True)
                continue
            print(f"backend={backend} {name}: decode ms/token, first and second run "
                  f"{[round(r.decode_ms_per_token, 1) for r in runs]}, prefill s "
                  f"{[round(r.prefill_seconds, 2) for r in runs]}", flush=True)


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
    parser.add_argument("--readings", nargs="+", choices=["decode", "rounding"], default=["decode", "rounding"])
    parser.add_argument("--policies", nargs="+", default=["FullCache", "SnapKV", "PyramidKV", "AdaKV"],
                        choices=sorted(POLICIES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM_SHAPES[args.shape]), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    if "decode" in args.readings:
        cold_and_warm_decode(model, 8192, args.policies)
    if "rounding" in args.readings:
        rounding_by_depth(model, 2048, 512)


if __name__ == "__main__":
    main()
