"""kvpress's half of the decoding check of DecodingEviction(merging="cam") against kvpress 0.5.5's CAMPress itself
(tests/test_decoding_merge.py, marked peer). Runs in the kvpress venv (scripts/kvpress_venv.sh): imports kvpress,
transformers and torch, never snapkv_lab.

    $VENV/bin/python benchmarks/_kvpress_cam_worker.py request.pt out.pt

request.pt (torch.save): {"model": a checkpoint folder (save_pretrained), "ids": (1, n) prompt ids, "new": tokens to
generate greedily, "seed": torch's global seed before generating (CAMPress's Bernoulli draws), "press": keyword
arguments of CAMPress besides base_press (KnormPress())}. out.pt: {"tokens": (new,) the generated ids, "keys",
"values": per layer the cache's (1, kv_heads, slots, head_dim) at the end}. The side-by-side worker
(_kvpress_worker.py) compares prefills only, where CAMPress keeps every position: this one decodes.
"""

from __future__ import annotations

import sys

import torch
from kvpress import CAMPress, KnormPress
from transformers import AutoModelForCausalLM, DynamicCache


def main(request_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    request = torch.load(request_path)
    model = AutoModelForCausalLM.from_pretrained(request["model"], attn_implementation="sdpa").eval()
    press = CAMPress(base_press=KnormPress(), **request["press"])
    ids, cache = request["ids"], DynamicCache()
    torch.manual_seed(request["seed"])
    with torch.no_grad(), press(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=request["new"], do_sample=False, eos_token_id=None)
    torch.save({"tokens": out[0, ids.shape[1]:], "keys": [layer.keys for layer in cache.layers],
                "values": [layer.values for layer in cache.layers]}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
