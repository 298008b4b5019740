"""The kvpress half of the side by side (benchmarks/kvpress_peer.py). Runs in the kvpress venv
(scripts/kvpress_venv.sh), never in snapkv_lab's environment: it imports kvpress, transformers 5.2 and torch,
never snapkv_lab.

    $VENV/bin/python benchmarks/_kvpress_worker.py request.json out.pt

request.json: {"model": checkpoint folder, "ids": [token ids], "presses": {name: "kvpress constructor
expression"}, "attn": "sdpa", "threads": int}. Each expression is evaluated with kvpress's names in scope
(e.g. "SnapKVPress(compression_ratio=0.75)"), and `seeded(press, seed)`, which fixes a random press's draws; optional
"values": [names] of (pruning, merging) presses whose kept values are returned too. With "more": true, once it has
taken those presses (and run the ones that run alone, below) the worker reads one more JSON line on stdin, {"presses":
{...}} and any of the request's other keys ("q_filters", "duo_pattern"): the presses that need what the caller's half
prepares, so that the caller can start the worker first and run its half meanwhile.
out.pt (torch.save): {"versions": {...}, "last_logits": (vocab,) float32 of the uncompressed prefill,
    "presses": {name: {"kept": [per layer (kv_heads, kept) long, sorted, -1 padded] or None, "error": str or None,
    and for the names in "values": "values": [per layer (kv_heads, kept, head_dim), in the kept positions' order]}}}.

The model is the checkpoint folder snapkv_lab loads (the bundled GGUF converted once to fp32 safetensors,
snapkv_lab.core.models.bundled_checkpoint(), tokenizer and chat template included), loaded by this transformers in
fp32: the same weights on both sides, and the tokenizer KVzipPress loads from model.config.name_or_path.

Every press runs under its own context manager, `with press(model)`, so its own `forward_hook` and `compress`
do the work. All presses but KVzip share one prefill: each press's hook is registered between two of ours, on
every attention layer, and forward hooks run in registration order; ours put the full keys and values back into
the cache before each press's hook (which prunes them in place) and read what it kept after it. The prefill's
own attention never reads a layer's cache after that layer's hooks, so each press sees exactly what it would
see alone. KVzipPress scores by extra reconstruction passes after its prefill and runs alone (two presses that score
alike share one reconstruction, each selecting with its own compress_post: run_kvzip); so do KVComposePress
(the prompt fed again), which prunes the cache as its context closes (run_kvcompose), and FastKVzipPress, which
selects once every layer is scored, after the prefill (run_post_prefill).

How kept positions are read: a press that prunes leaves (batch, kv_heads, kept, head_dim) keys in the cache;
each kept row is matched with the full keys' rows (post-RoPE keys of distinct positions never coincide).
KeyRerotationPress re-rotates the keys it keeps, which then match none: the indices it hands its `rerotate_keys`
are read instead (read_rerotation).
Head-wise presses (AdaKVPress, CriticalAdaKVPress, KVzipPress, KVComposePress(structured=False)) prune nothing and
leave `module.masked_key_indices` = (batch, head, position) of the masked pairs: their kept positions are the rest.

Timing mode (benchmarks/kvpress_side_by_side.py --timing), a long-lived worker:

    $VENV/bin/python benchmarks/_kvpress_worker.py --serve

reads one JSON request per line on stdin and answers one JSON line on stdout (everything else it or a library
prints goes to stderr). {"cmd": "load", "model", "attn", "threads", "no_eos"} loads the model and builds kvpress's
own pipeline, `pipeline("kv-press-text-generation", ...)`; {"cmd": "prepare", "context", "questions"} answers the
token ids that pipeline's preprocess makes of them; {"cmd": "run", "press", "context", "questions",
"max_new_tokens"} times one call `pipe(context, questions=..., press=..., max_new_tokens=...)` (wall and CPU
seconds of this process), the whole
protocol: tokenising, the compressed prefill, then per question its tokens and greedy decoding on the
compressed cache; {"cmd": "quit"}. no_eos sets generation_config.eos_token_id = [] so that every answer has
max_new_tokens tokens (the pipeline stops at those ids).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata as md
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch


def load_model(checkpoint: str, attn: str):
    """The model in fp32, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attn).eval()


def rows_to_positions(full: torch.Tensor, pruned: torch.Tensor, sort: bool = True) -> torch.Tensor:
    """(kv_heads, n, d) full keys, (kv_heads, m, d) pruned keys -> (kv_heads, m) positions, sorted (sort=False: in
    the pruned rows' own order).

    Each pruned row is looked up among the full rows by a hash of its bits, then checked equal bit for bit
    (post-RoPE keys of distinct positions never coincide; if two did, positions could not be told apart)."""
    n, d = full.shape[1], full.shape[2]
    bits = [t.float().contiguous().view(torch.int32).long() for t in (full, pruned)]
    weights = torch.randint(1, 2**31, (d,), generator=torch.Generator().manual_seed(0))
    hashed_full, hashed_pruned = ((b * weights).sum(-1) for b in bits)  # (kv_heads, n), (kv_heads, m); wraps: fine
    order = hashed_full.argsort(dim=-1)
    sorted_full = hashed_full.gather(-1, order)
    if bool((sorted_full[:, 1:] == sorted_full[:, :-1]).any()):
        raise RuntimeError("two key rows share a hash: positions cannot be read back from pruned keys")
    positions = order.gather(-1, torch.searchsorted(sorted_full, hashed_pruned).clamp(max=n - 1))
    if not torch.equal(full.gather(1, positions[..., None].expand(-1, -1, d)), pruned):
        raise RuntimeError("a pruned key row is not among the full keys")
    return positions.sort(dim=-1).values if sort else positions


def values_in_position_order(full: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(kv_heads, m, d) the values a press kept (a merging press's merged ones), in the order of their positions, as
    `rows_to_positions` lists them: full (kv_heads, n, d) keys before the press, keys, values (kv_heads, m, d) after."""
    order = rows_to_positions(full, keys, sort=False).argsort(dim=-1)
    return values.gather(1, order[..., None].expand_as(values))


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


def kept_positions(module, full: torch.Tensor, keys: torch.Tensor, may_keep_all: bool = False) -> torch.Tensor:
    """What a press kept in one layer: full (batch, kv_heads, n, d) keys before its hook, keys after it. may_keep_all:
    the press may leave a layer whole by its own decision (SimLayerKVPress's busy layers, DMSPress where no score falls
    below its threshold): then every position; otherwise a layer left whole is an error."""
    kv_heads, n = full.shape[1], full.shape[2]
    rerotated = getattr(module, "rerotated_indices", None)
    if rerotated is not None:
        module.rerotated_indices = None
        return rerotated[0].cpu()
    masked = getattr(module, "masked_key_indices", None)
    if masked is not None:
        return masked_to_positions(masked, kv_heads, n)
    if keys.shape[2] == n:
        if may_keep_all:
            return torch.arange(n).expand(kv_heads, -1).clone()
        raise RuntimeError(f"layer {module.layer_idx}: the press neither pruned nor masked any pair")
    return rows_to_positions(full[0].cpu(), keys[0].cpu())


# Presses that may leave a layer whole by their own decision (see kept_positions).
KEEP_ALL_PRESSES = ("SimLayerKVPress", "DMSPress")


def attention_modules(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def clear_masks(model) -> None:
    """kvpress's attention patch reads module.masked_key_indices: none may survive from an earlier press."""
    for module in attention_modules(model):
        module.masked_key_indices = None


def hooked(stack: contextlib.ExitStack, modules, hook) -> None:
    for module in modules:
        stack.callback(module.register_forward_hook(hook, with_kwargs=True).remove)


def run_shared_prefill(model, ids: torch.Tensor, presses: dict,
                       values: dict | None = None) -> tuple[dict, torch.Tensor]:
    """({name: {layer: kept}} of every press, (vocab,) last logits) from one prefill (see the module doc); the
    logits are the uncompressed model's: presses change the cache after each layer's attention, not its output.
    values: {name: {}} for the presses whose kept values are asked for, filled {layer: (kv_heads, kept, d)} in
    position order."""
    values = {} if values is None else values
    from transformers import DynamicCache

    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    kept: dict[str, dict[int, torch.Tensor]] = {name: {} for name in presses}
    modules = attention_modules(model)

    def snapshot(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        full[module.layer_idx] = (layer.keys, layer.values)

    def restore(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        layer.keys, layer.values = full[module.layer_idx]
        module.masked_key_indices = module.rerotated_indices = None

    def record(name):
        whole = type(presses[name]).__name__ in KEEP_ALL_PRESSES

        def hook(module, args, kwargs, output):
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            kept[name][module.layer_idx] = kept_positions(module, full[module.layer_idx][0], layer.keys, whole)
            if name in values:
                values[name][module.layer_idx] = values_in_position_order(
                    full[module.layer_idx][0][0].cpu(), layer.keys[0].cpu(), layer.values[0].cpu())
        return hook

    clear_masks(model)
    with contextlib.ExitStack() as stack:
        hooked(stack, modules, snapshot)
        for name, press in presses.items():
            hooked(stack, modules, restore)
            stack.enter_context(press(model))
            hooked(stack, modules, record(name))
        with torch.no_grad():
            logits = model(ids, past_key_values=DynamicCache(config=model.config)).logits[0, -1].float()
    return kept, logits


def given_filters(press, path: str | None) -> None:
    """QFilterPress with the filters snapkv_lab calibrated (saved at `path`, (layers, kv_heads, head_dim)) instead of
    the authors' published ones, which it would fetch from the Hub: negated, as the press keeps the lowest <f, k>
    (qfilter_press.py:176-178) and ours point along the queries."""
    if path is None:
        raise ValueError("QFilterPress needs the request's q_filters (the Hub is out of reach)")
    press.q_filters = -torch.load(path).float()
    press.post_init_from_model = lambda model: None


def given_pattern(press, pattern: dict | None) -> None:
    """DuoAttentionPress with snapkv_lab's head pattern instead of the published gates it would fetch from the web
    (duo_attention_press.py:123-144, load_attention_pattern). A press given a share of streaming heads
    (head_compression_ratio > 0) is handed our gates (layers x KV heads) and chooses its heads itself
    (post_init_from_model, :86-90); one given none (the default 0.0) is handed the streaming heads snapkv_lab chose.
    Both take our sink and recent sizes."""
    if pattern is None:
        raise ValueError("DuoAttentionPress needs the request's duo_pattern (the web is out of reach)")
    if press.head_compression_ratio > 0:
        gates = np.array(pattern["gates"], dtype=float)
        press.load_attention_pattern = lambda model: (pattern["sink_size"], pattern["recent_size"], gates)
        return
    press.sink_size, press.recent_size = pattern["sink_size"], pattern["recent_size"]
    press.streaming_mask = torch.tensor(pattern["streaming"], dtype=torch.bool)
    press.post_init_from_model = lambda model: None


def seeded(press, seed: int = 0):
    """`press` with torch's global generator seeded with seed * 100_003 + layer before each layer's scoring, so that a
    press drawing its random projection from it (LeverageScorePress, CompactorPress, CURPress with
    use_random_leverage) draws what snapkv_lab's policy of that `seed` draws in that layer (its generator's seed)."""
    score = press.score

    def seeded_score(module, *args, **kwargs):
        torch.manual_seed(seed * 100_003 + module.layer_idx)
        return score(module, *args, **kwargs)

    press.score = seeded_score
    return press


def given_statistics(press, path: str | None) -> None:
    """ExpectedAttentionStatsPress with the query statistics snapkv_lab computed by kvpress's recipe (safetensors:
    `mean` (layers, heads, d), `cov` (layers, heads, d, d), bfloat16) instead of the Hub's, which its
    post_init_from_model would load (expected_attention_with_stats.py:72-81); it loads nothing once mu and cov are
    set, and casts them to the model's dtype as it would (:80-81)."""
    if path is None:
        raise ValueError("ExpectedAttentionStatsPress needs the request's query_statistics (the Hub is out of reach)")
    from safetensors.torch import load_file

    stored = load_file(path)
    press.mu, press.cov = stored["mean"].float(), stored["cov"].float()


def given_curve(press, path: str | None) -> None:
    """LUKVPress with the budget curve snapkv_lab's LUKV reads (a .npy of (99, layers, KV heads) prune ratios) instead
    of the one it would download for Llama-3.1-8B-Instruct (lukv_press.py:33-36); its post_init_from_model loads
    nothing once `_budget_curves` is set (:94-97)."""
    if path is None:
        raise ValueError("LUKVPress needs the request's lukv_curve (GitHub is out of reach, and its curve is another "
                         "model's)")
    import numpy

    press._budget_curves = numpy.load(path, allow_pickle=False)


def read_rerotation(press) -> None:
    """KeyRerotationPress leaving the sorted kept indices it re-rotates (key_rerotation_press.py:147-150) on the
    module, as `module.rerotated_indices` (batch, kv_heads, kept), for `kept_positions`."""
    rerotate = press.rerotate_keys

    def recording(module, indices, keys):
        module.rerotated_indices = indices
        return rerotate(module, indices, keys)

    press.rerotate_keys = recording


def given_kvzap(press, weights: dict | None) -> None:
    """KVzapPress with the surrogate snapkv_lab trained (a safetensors file per model_type, its shapes in the
    metadata, parameters named as kvpress's KVzapModel's) instead of nvidia's, which it would fetch from the Hub."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = (weights or {}).get(press.model_type)
    if path is None:
        raise ValueError(f"KVzapPress({press.model_type}) needs the request's kvzap_weights (the Hub is out of reach): "
                         f"train them with scripts/train_kvzap.py --model-type {press.model_type}")
    with safe_open(path, "pt") as file:
        metadata = file.metadata()
    layers = json.loads(metadata["layers"])
    if layers != list(range(len(layers))):
        raise ValueError(f"{path} holds modules for layers {layers} only; KVzapModel needs every layer's")
    config = KVzapConfig(input_dim=int(metadata["input_dim"]), output_dim=int(metadata["output_dim"]),
                         n_modules=len(layers), hidden_dim=json.loads(metadata["hidden_dim"]))
    surrogate = KVzapModel(config)
    surrogate.load_state_dict(load_file(path))
    press.kvzap_model = surrogate.eval()
    press.post_init_from_model = lambda model: None


def given_gates(press, path: str | None) -> None:
    """FastKVzipPress with the gates snapkv_lab's FastKVzip reads (a safetensors file of one gate per layer, keyed
    "layers.<layer>.<parameter>", kvpress's FastKVzipGate's parameter names; (input_dim, kv_heads, group) in its
    metadata) instead of the published ones it would fetch from the Hub (fastkvzip_press.py:76-102); its
    post_init_from_model loads nothing once `gates` is set (:172-175)."""
    if path is None:
        raise ValueError("FastKVzipPress needs the request's fastkvzip_gates (the Hub is out of reach, and its gates "
                         "are other models')")
    from kvpress.presses.fastkvzip_press import FastKVzipGate
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as file:
        metadata = file.metadata()
    layers = json.loads(metadata["layers"])
    if layers != list(range(len(layers))):
        raise ValueError(f"{path} holds gates for layers {layers} only; FastKVzipPress scores every layer")
    input_dim, kv_heads, group = json.loads(metadata["shape"])
    stored = load_file(path)
    press.gates = []
    for layer in layers:
        gate = FastKVzipGate(layer, input_dim, kv_heads, group, torch.float32)
        prefix = f"layers.{layer}."
        gate.load_state_dict({k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)})
        press.gates.append(gate.eval())


# (kvzip_plus_normalization, chunk_size) -> the scores a KVzipPress's reconstruction left (score_val) on this request's
# ids: what its other fields (compression_ratio, layerwise, n_sink) leave alone, as compress_post alone reads them
KVZIP_SCORES: dict = {}


def run_kvzip(model, ids: torch.Tensor, press) -> dict:
    """{layer: kept} of a KVzipPress: its own prefill, its reconstruction passes, then compress_post's masks. A press
    that scores as one run before (KVZIP_SCORES: KVzip layerwise after KVzip) takes that run's scores into its own
    compress_post, which selects from them (kvzip_press.py:369-405), instead of reconstructing the prompt again."""
    from transformers import DynamicCache

    clear_masks(model)
    key = (press.kvzip_plus_normalization, press.chunk_size)
    if key in KVZIP_SCORES:
        press.score_val = KVZIP_SCORES[key].clone()  # compress_post writes the sinks' scores into it
        press.compress_post(model)
    else:
        select = press.compress_post

        def recorded(model):
            KVZIP_SCORES[key] = press.score_val.clone()
            select(model)

        press.compress_post = recorded
        with torch.no_grad(), press(model):
            model(ids, past_key_values=DynamicCache(config=model.config))
    return masked_kept(model, ids, press)


def run_post_prefill(model, ids: torch.Tensor, press) -> dict:
    """{layer: kept} of a press that scores in its prefill and masks after it (FastKVzipPress: compress_post, once
    every layer is scored), alone."""
    from transformers import DynamicCache

    clear_masks(model)
    with torch.no_grad(), press(model):
        model(ids, past_key_values=DynamicCache(config=model.config))
    return masked_kept(model, ids, press)


def masked_kept(model, ids: torch.Tensor, press) -> dict:
    """{layer: kept} from the masks a head-wise press left on every attention module."""
    n, kv_heads = ids.shape[1], model.config.num_key_value_heads
    kept = {}
    for module in attention_modules(model):
        if module.masked_key_indices is None:
            raise RuntimeError(f"layer {module.layer_idx}: {type(press).__name__} masked nothing")
        kept[module.layer_idx] = masked_to_positions(module.masked_key_indices, kv_heads, n)
    return kept


def run_kvcompose(model, ids: torch.Tensor, press) -> dict:
    """{layer: kept} of a KVComposePress, alone: it patches the model's forward for its prefill and its second pass
    of the prompt, and compresses the cache as its context closes (kvcompose_press.py:423-441). Structured, the
    cache's kept keys are read back against its first n keys, copied before it closes; unstructured, its masks."""
    from transformers import DynamicCache

    clear_masks(model)
    cache, n = DynamicCache(config=model.config), ids.shape[1]
    with torch.no_grad():
        with press(model):
            model(ids, past_key_values=cache)
            full = [layer.keys[:, :, :n].clone() for layer in cache.layers]
    return {module.layer_idx: kept_positions(module, keys, layer.keys)
            for module, layer, keys in zip(attention_modules(model), cache.layers, full, strict=True)}


def with_window(press, window: int):
    """A FinchPress whose window is the last `window` tokens of the ids, where the pipeline would find a delimiter
    before the question (finch_press.py:139-153): the hook never fires on an id of -1, so the window stays as set, and
    the ids need no delimiter token (which update_model_and_tokenizer would add to the model's vocabulary)."""
    press.delimiter_token_id, press.window_size = -1, window
    return press


def run_eager(model, ids: torch.Tensor, name: str, press) -> dict:
    """{layer: kept} of a press that reads the attention weights (ObservedAttentionPress: "Requires
    attn_implementation='eager'", observed_attention_press.py:23), alone in a prefill under eager attention; the model
    goes back to the request's attention after it."""
    former = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return run_shared_prefill(model, ids, {name: press})[0][name]
    finally:
        model.set_attn_implementation(former)


def main(request_path: str, out_path: str) -> None:
    import kvpress

    request = json.loads(Path(request_path).read_text())
    torch.set_num_threads(request.get("threads", torch.get_num_threads()))
    start = time.perf_counter()
    model = load_model(request["model"], request.get("attn", "sdpa"))
    print(f"kvpress worker: model loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    ids = torch.tensor([request["ids"]], dtype=torch.long)
    scope = {name: getattr(kvpress, name) for name in dir(kvpress) if not name.startswith("_")}
    scope["seeded"] = seeded
    scope["with_window"] = with_window
    n_layers = model.config.num_hidden_layers

    results, shared = {}, {}

    def admit(name: str, expression: str) -> None:
        """Run a press that runs alone now; keep the others for the shared prefill."""
        try:
            press = eval(expression, scope)  # noqa: S307 (expressions come from the side-by-side rows)
        except Exception as err:
            results[name] = {"kept": None, "error": f"{type(err).__name__}: {err}"}
            return
        if isinstance(press, kvpress.QFilterPress):
            given_filters(press, request.get("q_filters"))
        if isinstance(press, kvpress.DuoAttentionPress):
            given_pattern(press, request.get("duo_pattern"))
        if isinstance(press, kvpress.KVzapPress):
            given_kvzap(press, request.get("kvzap_weights"))
        if isinstance(press, kvpress.KeyRerotationPress):
            read_rerotation(press)
        if isinstance(press, kvpress.ExpectedAttentionStatsPress):
            given_statistics(press, request.get("query_statistics"))
        if isinstance(press, kvpress.LUKVPress):
            given_curve(press, request.get("lukv_curve"))
        if isinstance(press, kvpress.FastKVzipPress):
            given_gates(press, request.get("fastkvzip_gates"))
        if isinstance(press, kvpress.ObservedAttentionPress):
            try:
                results[name] = {"kept": run_eager(model, ids, name, press), "error": None}
            except Exception as err:  # one failing press must not hide the others
                traceback.print_exc()
                results[name] = {"kept": None, "error": f"{type(err).__name__}: {err}"}
        elif isinstance(press, (kvpress.KVzipPress, kvpress.KVComposePress, kvpress.FastKVzipPress)):
            # isinstance, not type: KVgradPress is a KVzipPress and shares its reconstruction runner
            run = (run_kvcompose if isinstance(press, kvpress.KVComposePress)
                   else run_post_prefill if isinstance(press, kvpress.FastKVzipPress) else run_kvzip)
            try:
                start = time.perf_counter()
                results[name] = {"kept": run(model, ids, press), "error": None}
                print(f"kvpress worker: {name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            except Exception as err:  # one failing press must not hide the others
                traceback.print_exc()
                results[name] = {"kept": None, "error": f"{type(err).__name__}: {err}"}
        else:
            shared[name] = press

    for name, expression in request["presses"].items():
        admit(name, expression)
    if request.get("more"):  # the rest, once the caller's half has prepared what they need
        later = json.loads(sys.stdin.readline())
        request.update({key: value for key, value in later.items() if key != "presses"})
        for name, expression in later["presses"].items():
            admit(name, expression)

    start = time.perf_counter()
    values = {name: {} for name in request.get("values", []) if name in shared}
    try:
        kept, last_logits = run_shared_prefill(model, ids, shared, values)
        results.update({name: {"kept": layers, "error": None} for name, layers in kept.items()})
    except Exception:  # one failing press stops the shared prefill: run each alone, to tell which one failed
        traceback.print_exc()
        last_logits = run_shared_prefill(model, ids, {})[1]
        for name, press in shared.items():
            try:
                results[name] = {"kept": run_shared_prefill(model, ids, {name: press})[0][name], "error": None}
            except Exception as err:
                results[name] = {"kept": None, "error": f"{type(err).__name__}: {err}"}
    print(f"kvpress worker: {len(shared)} presses in one prefill, {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for name, result in results.items():
        if result["kept"] is not None:
            missing = [layer for layer in range(n_layers) if layer not in result["kept"]]
            result["kept"] = None if missing else [result["kept"][layer] for layer in range(n_layers)]
            result["error"] = f"no compression recorded in layers {missing}" if missing else None
        print(f"kvpress {name}: {result['error'] or 'ok'}", file=sys.stderr)
        if name in values:
            result["values"] = [values[name].get(layer) for layer in range(n_layers)]
    versions = {pkg: md.version(pkg) for pkg in ("kvpress", "transformers", "torch")}
    torch.save({"versions": versions, "last_logits": last_logits, "presses": results}, out_path)


def serve() -> None:
    """The timing mode's loop (see the module doc)."""
    answer_to = os.fdopen(os.dup(1), "w")  # the replies' channel; fd 1 itself goes to stderr from here on
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import kvpress  # noqa: F401 (registers the "kv-press-text-generation" pipeline)
    from transformers import AutoTokenizer, pipeline

    scope = {name: getattr(kvpress, name) for name in dir(kvpress) if not name.startswith("_")}
    pipe = None
    for line in sys.stdin:
        request = json.loads(line)
        cmd, reply = request["cmd"], {}
        try:
            if cmd == "quit":
                break
            if cmd == "load":
                torch.set_num_threads(request["threads"])
                start = time.perf_counter()
                model = load_model(request["model"], request.get("attn", "sdpa"))
                if request.get("no_eos"):
                    model.generation_config.eos_token_id = []
                tokenizer = AutoTokenizer.from_pretrained(request["model"])
                pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
                reply = {"seconds": time.perf_counter() - start, "threads": torch.get_num_threads(),
                         "versions": {pkg: md.version(pkg) for pkg in ("kvpress", "transformers", "torch")}}
            elif cmd == "prepare":
                tensors = pipe.preprocess(request["context"], request["questions"], answer_prefix="",
                                          max_context_length=int(1e10))
                reply = {"context_ids": tensors["context_ids"][0].tolist(),
                         "question_ids": [q[0].tolist() for q in tensors["questions_ids"]]}
            elif cmd == "run":
                press = eval(request["press"], scope)  # noqa: S307 (expressions come from the side-by-side rows)
                gc.collect()
                start, cpu = time.perf_counter(), time.process_time()
                out = pipe(request["context"], questions=request["questions"], press=press,
                           max_new_tokens=request["max_new_tokens"])
                reply = {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
                         "answers": out["answers"]}
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as err:  # the caller decides; the worker keeps serving
            traceback.print_exc()
            reply = {"error": f"{type(err).__name__}: {err}"}
        answer_to.write(json.dumps(reply) + "\n")
        answer_to.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
        sys.exit(0)
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
