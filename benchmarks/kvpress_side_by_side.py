"""Side by side with NVIDIA kvpress 0.5.5: which prompt positions each of our policies keeps, next to what the
matching kvpress press keeps, layer by layer and KV head by KV head, on the bundled SmolLM2-135M-Instruct.

    bash scripts/kvpress_venv.sh                      # once: kvpress in its own venv (it needs transformers<5.3)
    python3 benchmarks/kvpress_side_by_side.py        # --tokens 1000 --ratio 0.75 by default

Two halves, two environments. This script (snapkv_lab's environment, transformers 5.23) writes the prompt's
token ids to a JSON request, runs each of our policies with `snapkv_lab.generate(..., max_new_tokens=1)` and
reads `kept_indices`; then it runs benchmarks/_kvpress_worker.py in the kvpress venv on the same ids and the
same GGUF weights, which records the positions each press kept per layer and KV head. The two are compared
here. kvpress is never imported by snapkv_lab, and CI does not depend on it.

Budgets: kvpress removes a fraction `compression_ratio` of the n prompt positions and keeps
n_kept = max(1, int(n * (1 - ratio))) per KV head (kvpress.utils.compute_n_kept); ours keep `capacity`
positions per KV head, window included, so capacity = that same n_kept.

Rows: SPECS below, one (our policy, our constructor kwargs, kvpress press expression, note) per method. A row
whose policy is not (yet) in snapkv_lab.POLICIES is skipped with a note, so the table fills in as the method
branches merge. Output: a markdown table on stdout, benchmarks/results/kvpress_side_by_side.{csv,md} and the
per-layer detail in kvpress_side_by_side_layers.csv.

Columns: jaccard = |ours & theirs| / |ours | theirs| of the kept position sets of one layer and KV head;
jaccard_mean over every (layer, KV head); jaccard_min_layer the worst layer's mean over its KV heads;
jaccard_scored the same mean restricted to the positions before our row's protected window (the part both
sides actually chose); identical_layers the fraction of layers whose sets are equal in every KV head;
kept_ours / kept_theirs the positions kept per KV head (mean; min-max when budgets vary by layer or head).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's snapkv_lab, before any installed copy (and before _common imports it)
from _common import markdown  # noqa: E402 (benchmarks/ is on sys.path when this script runs)
RESULTS = ROOT / "benchmarks" / "results"
WORKER = ROOT / "benchmarks" / "_kvpress_worker.py"
DEFAULT_VENV = Path(os.environ.get("KVPRESS_VENV", "/work/kvpress-venv"))

WINDOW, KERNEL = 32, 7  # SnapKV-family settings given to both sides (kvpress defaults: 64 and 5)
SNAP_PRESS = f"SnapKVPress(compression_ratio={{ratio}}, window_size={WINDOW}, kernel_size={KERNEL})"

# (row label, our policy name, our kwargs, kvpress press expression, note on design differences).
# Our kwargs: capacity is filled in; a value ("Name", {kwargs}) is a nested policy built from POLICIES.
# Press expressions are evaluated in the kvpress venv with kvpress's names in scope; {ratio} is filled in.
SPECS = [
    ("SnapKV", "SnapKV", dict(window_size=WINDOW, kernel_size=KERNEL), SNAP_PRESS,
     "pooling: ours max_pool1d (paper and official code), kvpress avg_pool1d (zero-padded, count_include_pad). "
     "Same elsewhere: window = last 32 queries' softmax over all keys (causal inside the window), pooled per "
     "query head, then averaged over each GQA group; window always kept (kvpress pads its scores with max+1), "
     "its 32 positions counted inside n_kept. Scores: ours the sum over the window, kvpress the mean (same order)."),
    ("SnapKV avg-pool", "SnapKV", dict(window_size=WINDOW, kernel_size=KERNEL, pooling="avg"), SNAP_PRESS,
     "ours switched to kvpress's avg pooling: isolates the pooling difference of the row above."),
    ("StreamingLLM", "StreamingLLM", dict(window_size=WINDOW, sinks=4), "StreamingLLMPress(compression_ratio={ratio}, n_sink=4)",
     "both keep the 4 sinks plus the most recent n_kept - 4 positions; ours splits the recent part into the "
     "prefix's most recent picks plus the window, which is the same set."),
    ("TOVA", "TOVA", dict(window_size=1), "TOVAPress(compression_ratio={ratio})",
     "kvpress averages the last token's attention over ALL query heads (attn_weights.mean(1)) and repeats it to "
     "every KV head: one selection shared by all KV heads; the last token is protected (padded with max+1)."),
    ("KNorm", "KNorm", dict(window_size=1), "KnormPress(compression_ratio={ratio})",
     "kvpress scores -||k|| over every position and protects none (no window); ours always keeps window_size >= 1 "
     "last positions (1 here)."),
    ("PyramidKV", "PyramidKV", dict(window_size=WINDOW, kernel_size=KERNEL),
     f"PyramidKVPress(compression_ratio={{ratio}}, window_size={WINDOW}, kernel_size={KERNEL})",
     "kvpress falls back to SnapKV's flat budget round(n*(1-ratio)) whenever min_num = (n*(1-ratio))/beta < "
     "window_size (check q_len >= max_num >= min_num >= window_size), e.g. n=1000, ratio 0.75, beta 20: 12.5 < 32."),
    ("ChunkKV", "ChunkKV", dict(window_size=WINDOW, chunk_size=20, policy=("SnapKV", dict(kernel_size=KERNEL))),
     f"ChunkKVPress(press={SNAP_PRESS}, chunk_length=20)",
     "kvpress sums the inner scores over KV heads (global_scores.sum(dim=1)): one chunk choice shared by all "
     "heads; chunks tile the whole prompt, window included (window chunks win through their max+1 scores); "
     "keeps int(n_chunks*(1-ratio)) whole chunks, so fewer than n_kept positions."),
    ("CriticalKV", "CriticalKV", dict(window_size=WINDOW, policy=("SnapKV", dict(kernel_size=KERNEL))),
     f"CriticalKVPress(press={SNAP_PRESS})",
     "stage 1: kvpress keeps int(n_kept*0.5) top inner scores, the 32 window positions among them; ours "
     "floor((capacity - window)*0.5) prefix picks plus the window. Stage 2 rescales by ||W_o v||_1 averaged "
     "over the GQA group in both."),
    ("AdaKV", "AdaKV", dict(window_size=WINDOW, alpha_safeguard=0.2, policy=("SnapKV", dict(kernel_size=KERNEL))),
     f"AdaKVPress(press={SNAP_PRESS}, alpha_safeguard=0.2)",
     "kvpress does not prune: it masks the bottom kv_heads*(n-n_kept) scores across the layer's heads "
     "(module.masked_key_indices), so head budgets are ragged; window protected by the inner press's max+1."),
    # The same wrappers over SnapKV with kvpress's average pooling: what is left is the design difference.
    ("PyramidKV beta=4 avg-pool", "PyramidKV", dict(window_size=WINDOW, kernel_size=KERNEL, pooling="avg", beta=4),
     f"PyramidKVPress(compression_ratio={{ratio}}, window_size={WINDOW}, kernel_size={KERNEL}, beta=4)",
     "beta 4 keeps kvpress's smallest layer budget above the window, so neither side falls back to a flat budget; "
     "avg pooling as kvpress's SnapKV."),
    ("ChunkKV avg-pool", "ChunkKV", dict(window_size=WINDOW, chunk_size=20, policy=("SnapKV", dict(kernel_size=KERNEL, pooling="avg"))),
     f"ChunkKVPress(press={SNAP_PRESS}, chunk_length=20)", "inner SnapKV with kvpress's avg pooling; chunk choice as above."),
    ("CriticalKV avg-pool", "CriticalKV", dict(window_size=WINDOW, policy=("SnapKV", dict(kernel_size=KERNEL, pooling="avg"))),
     f"CriticalKVPress(press={SNAP_PRESS})", "inner SnapKV with kvpress's avg pooling; stage split as above."),
    ("AdaKV avg-pool", "AdaKV", dict(window_size=WINDOW, alpha_safeguard=0.2, policy=("SnapKV", dict(kernel_size=KERNEL, pooling="avg"))),
     f"AdaKVPress(press={SNAP_PRESS}, alpha_safeguard=0.2)", "inner SnapKV with kvpress's avg pooling."),
    ("ExpectedAttention", "ExpectedAttention", dict(window_size=1, n_future_positions=512, n_sink=4),
     "ExpectedAttentionPress(compression_ratio={ratio}, n_future_positions=512, n_sink=4)",
     "kvpress protects the n_sink first positions and no window; ours also keeps window_size >= 1 last "
     "positions (1 here). Query statistics from pre-RoPE queries (kvpress) vs un-rotated post-RoPE (ours)."),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length (Paul Graham essays, default 1000)")
    parser.add_argument("--ratio", type=float, default=0.75, help="kvpress compression_ratio, fraction removed (default 0.75)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"kvpress venv (default {DEFAULT_VENV}, or $KVPRESS_VENV)")
    parser.add_argument("--only", nargs="*", help="row labels to run (default all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the csv/md results")
    return parser.parse_args(argv)


def check_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    missing = not python.exists() or subprocess.run(
        [str(python), "-c", "import kvpress"], capture_output=True).returncode != 0
    if missing:
        sys.exit(f"kvpress venv not found or incomplete at {venv}.\n"
                 f"Create it with:  bash scripts/kvpress_venv.sh   (or pass --venv / set KVPRESS_VENV)")
    return python


def n_kept(n: int, ratio: float) -> int:
    """kvpress.utils.compute_n_kept, for 0 <= ratio < 1."""
    return max(1, int(n * (1 - ratio)))


def build_policy(policies: dict, name: str, kwargs: dict, capacity: int | None = None):
    kwargs = {key: build_policy(policies, *value) if isinstance(value, tuple) else value for key, value in kwargs.items()}
    if capacity is not None:
        kwargs["capacity"] = capacity
    return policies[name](**kwargs)


def run_ours(model, tokenizer, ids: torch.Tensor, rows, capacity: int) -> dict:
    """{label: (per-layer (kv_heads, kept) long, -1 padded) or an error note}."""
    import snapkv_lab

    out = {}
    for label, name, kwargs, _, _ in rows:
        nested = [v[0] for v in kwargs.values() if isinstance(v, tuple)]
        absent = [n for n in [name, *nested] if n not in snapkv_lab.POLICIES]
        if absent:
            out[label] = f"skipped: {', '.join(absent)} not in snapkv_lab.POLICIES yet"
            continue
        try:
            policy = build_policy(snapkv_lab.POLICIES, name, kwargs, capacity)
            result = snapkv_lab.generate(model, tokenizer, ids, policy=policy, max_new_tokens=1)
            out[label] = [kept[0].long() for kept in result.kept_indices]
        except Exception as err:  # a constructor that changed on a branch must not hide the other rows
            out[label] = f"failed: {type(err).__name__}: {err}"
        print(f"ours {label}: {'ok' if not isinstance(out[label], str) else out[label]}", file=sys.stderr)
    return out


def run_kvpress(python: Path, ids: list[int], rows, ratio: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "kvpress.pt"
        presses = {label: press.format(ratio=ratio) for label, _, _, press, _ in rows}
        request.write_text(json.dumps({"ids": ids, "presses": presses, "attn": "sdpa"}))
        env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        done = subprocess.run([str(python), str(WORKER), str(request), str(result)], env=env)
        if done.returncode != 0:
            sys.exit(f"the kvpress worker failed (exit {done.returncode}); see its output above")
        return torch.load(result)


def as_sets(kept: torch.Tensor) -> list[set[int]]:
    return [set(int(p) for p in row if p >= 0) for row in kept]


def compare(ours: list[torch.Tensor], theirs: list[torch.Tensor], scored_below: int):
    """Per-layer rows and the summary of one method."""
    layers = []
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        sa, sb = as_sets(a), as_sets(b)
        if len(sa) != len(sb):
            raise ValueError(f"layer {layer}: {len(sa)} KV heads ours, {len(sb)} theirs")
        jac = [len(x & y) / len(x | y) for x, y in zip(sa, sb)]
        scored = []
        for x, y in zip(sa, sb):
            x, y = {p for p in x if p < scored_below}, {p for p in y if p < scored_below}
            scored.append(len(x & y) / len(x | y) if x | y else 1.0)
        layers.append(dict(layer=layer, jaccard=sum(jac) / len(jac), jaccard_min_head=min(jac),
                           jaccard_scored=sum(scored) / len(scored), identical=all(x == y for x, y in zip(sa, sb)),
                           kept_ours=[len(x) for x in sa], kept_theirs=[len(y) for y in sb]))
    return layers


def count(kept_lists) -> str:
    flat = [k for per_layer in kept_lists for k in per_layer]
    mean = sum(flat) / len(flat)
    text = f"{mean:.0f}" if mean == int(mean) else f"{mean:.1f}"
    return text if min(flat) == max(flat) else f"{text} ({min(flat)}-{max(flat)})"


def summarise(label: str, layers, note: str) -> dict:
    n_heads = len(layers[0]["kept_ours"])
    per_head = [layer["jaccard"] for layer in layers]
    return dict(method=label, jaccard_mean=round(sum(per_head) / len(per_head), 4),
                jaccard_min_layer=round(min(per_head), 4),
                worst_layer=min(layers, key=lambda layer: layer["jaccard"])["layer"],
                jaccard_scored=round(sum(layer["jaccard_scored"] for layer in layers) / len(layers), 4),
                identical_layers=round(sum(layer["identical"] for layer in layers) / len(layers), 4),
                kept_ours=count([layer["kept_ours"] for layer in layers]),
                kept_theirs=count([layer["kept_theirs"] for layer in layers]),
                kv_heads=n_heads, note=note)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not 0 < args.ratio < 1:
        sys.exit(f"--ratio must lie in (0, 1), got {args.ratio}")
    python = check_venv(args.venv)
    rows = [spec for spec in SPECS if not args.only or spec[0] in args.only]

    import snapkv_lab
    from snapkv_lab.corpus import haystack_ids

    print(f"snapkv_lab from {Path(snapkv_lab.__file__).parent}; policies: {', '.join(snapkv_lab.POLICIES)}", file=sys.stderr)

    torch.manual_seed(0)
    model, tokenizer = snapkv_lab.load_model(device="cpu", dtype="float32", attn_implementation="sdpa")
    ids = haystack_ids(tokenizer, args.tokens)
    capacity = n_kept(len(ids), args.ratio)
    tensor_ids = torch.tensor([ids])
    print(f"prompt: {len(ids)} tokens, compression_ratio {args.ratio} -> kvpress n_kept = our capacity = {capacity} "
          f"per KV head; model {model.config.name_or_path}, {model.config.num_hidden_layers} layers, "
          f"{model.config.num_attention_heads} heads / {model.config.num_key_value_heads} KV heads", file=sys.stderr)

    start = time.perf_counter()
    ours = run_ours(model, tokenizer, tensor_ids, rows, capacity)
    with torch.no_grad():
        our_logits = model(tensor_ids).logits[0, -1].float()
    print(f"ours: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    start = time.perf_counter()
    ran = [row for row in rows if not str(ours[row[0]]).startswith("skipped")]  # no press for a skipped row
    theirs = run_kvpress(python, ids, ran, args.ratio)
    print(f"kvpress: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    logit_gap = float((our_logits - theirs["last_logits"]).abs().max())

    summary, detail = [], []
    for label, name, kwargs, press, note in rows:
        mine, other = ours[label], theirs["presses"].get(label, {"error": None})
        if isinstance(mine, str) or other["error"]:
            why = mine if isinstance(mine, str) else f"kvpress failed: {other['error']}"
            summary.append(dict(method=label, note=f"{why}. {note}"))
            continue
        scored_below = len(ids) - kwargs.get("window_size", 1)
        layers = compare(mine, other["kept"], scored_below)
        summary.append(summarise(label, layers, note))
        detail += [dict(method=label, **{k: v for k, v in layer.items() if not k.startswith("kept")},
                        kept_ours=count([layer["kept_ours"]]), kept_theirs=count([layer["kept_theirs"]]))
                   for layer in layers]

    table = pd.DataFrame(summary)
    header = (f"kvpress {theirs['versions']['kvpress']} (transformers {theirs['versions']['transformers']}) vs "
              f"snapkv_lab {snapkv_lab.__version__} (transformers {__import__('transformers').__version__}) on "
              f"{model.config.name_or_path}, fp32, sdpa; {len(ids)}-token Paul Graham prompt, compression_ratio "
              f"{args.ratio}, n_kept = capacity = {capacity}; max |logit gap| of the two uncompressed prefills: "
              f"{logit_gap:.2e}")
    shown = table.astype(object).where(table.notna(), "-")
    markdown_table = markdown(shown, {c: ".4f" for c in table.columns if c.startswith(("jaccard", "identical"))})
    print(header + "\n\n" + markdown_table)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "kvpress_side_by_side.csv", index=False)
    pd.DataFrame(detail).to_csv(args.out / "kvpress_side_by_side_layers.csv", index=False)
    (args.out / "kvpress_side_by_side.md").write_text(
        f"# snapkv_lab vs kvpress, kept positions\n\n{header}\n\nCommand: `python3 benchmarks/kvpress_side_by_side.py "
        f"--tokens {args.tokens} --ratio {args.ratio}`\n\n{markdown_table}\n")
    print(f"\nwrote {args.out}/kvpress_side_by_side.csv, .md and kvpress_side_by_side_layers.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
