"""Time and peak memory of attention capture vs plain generation vs eager output_attentions.

    python benchmarks/bench_capture.py                       # 1k, 2k, 4k, 8k prompts, 64 new tokens
    python benchmarks/bench_capture.py --lengths 1024 --new-tokens 16
    python benchmarks/bench_capture.py --device cuda --dtype bf16 --shape llama3-8b --attn flash_attention_2 \
        --lengths 8192 16384 32768 --modes generate capture
    python benchmarks/bench_capture.py --model gemma-3-270m --lengths 4096 8192 16384 32752 --new-tokens 16 \
        --modes generate capture --check-exact     # a real model to its full 32k context (docs/capture_long.md)

Each measurement runs in a fresh process, so its peak memory is its own: the peak RSS (ru_maxrss) on CPU, the
peak of the memory torch allocated on a GPU. "extra" is the peak minus the memory in use with the model loaded:
what the run itself costs. Capture keeps its trace on the model's device (store_device=None), so that on a GPU
its memory counts where eager's attention maps do. On CPU, eager output_attentions runs under an address-space
cap (--eager-cap-gb) so that at long prompts it fails cleanly instead of swapping the machine, and so do the
others under --cap-gb where given; on a GPU the GPU's own memory is the cap. A run that runs out of memory is
reported as such. Wall time covers the generation call alone (prefill and new tokens), read with the device
synchronised. A bundled model's prompts (SmolLM2 by
default, --model gemma-3-270m) are BOS and real text (Paul Graham's essays); a random model's are random token ids.
Every row also records the new token ids, so a table says whether capture generated what plain generate did, and
the 1-minute load average when the run ended (the machine may be shared).

--check-exact (capture runs) then checks the trace, after the memory and time are read: eager output_attentions
cannot run at long prompts, so sampled blocks stand in for the whole map. For the first and last sliding-window
and global layers, blocks of --check-rows query rows (random prompt rows, the prompt's last rows, the generated
rows), all heads, are recomputed in float64 from the softmax definition and the trace's own queries, keys and
settings, and compared with what trace.attention returns. The returned rows must sum to 1 and give no weight to
keys a row cannot see (the future; past a sliding layer's window). Since that reference shares the trace's
queries and keys, every layer of the first --check-eager-prefix prompt tokens is also compared with eager
output_attentions of a fresh eager model on those tokens alone (causal: they attend within that prefix only). The
first layer's difference is reported apart: only there do both backends see the same inputs; every later layer also
carries the two backends' rounding of earlier layers, which in bf16 on a deep model outgrows any capture error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import pandas as pd
import torch
from _common import (
    OUT_OF_MEMORY,
    PeakMemory,
    add_model_options,
    attempt,
    describe,
    load_subject,
    parse_model_options,
    report,
    result_name,
)

from snapkv_lab import AttentionTrace, capture
from snapkv_lab.core.attention import AttentionSettings
from snapkv_lab.core.inputs import check_context_length
from snapkv_lab.core.timing import stopwatch

MODES = ("generate", "capture", "eager")


def labels(attn: str) -> dict[str, str]:
    return {"generate": f"plain {attn} model.generate", "capture": f"snapkv_lab.capture ({attn})",
            "eager": "eager generate, output_attentions=True"}


def generation(mode: str, subject, ids: torch.Tensor, new_tokens: int):
    with torch.inference_mode():
        if mode == "capture":
            return capture(subject.model, subject.tokenizer, ids, max_new_tokens=new_tokens, stop_at_eos=False,
                           store_device=None, progress=False)
        return subject.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      output_attentions=mode == "eager", return_dict_in_generate=True)


def new_ids(output, prompt_len: int) -> list[int]:
    """The generated token ids of a capture's trace or a generate output; [] for a failed run (output None)."""
    if output is None:
        return []
    if isinstance(output, AttentionTrace):
        return output.token_ids[output.prompt_len:].tolist()
    return output.sequences[0, prompt_len:].tolist()


def child(args: argparse.Namespace, mode: str, length: int) -> dict:
    device = torch.device(args.device)
    subject = load_subject(args, attn="eager" if mode == "eager" else None)
    # Every mode refuses a run past the model's context (capture would; generate would go on into garbage).
    check_context_length(subject.model, length + args.new_tokens, "the prompt and its new tokens")
    ids = subject.prompt(length).to(device)
    with torch.inference_mode():
        subject.model(ids[:, :8])  # touch every weight page first (loading may only map the file); warms kernels up
    cap_gb = args.eager_cap_gb if mode == "eager" else args.cap_gb
    if cap_gb and device.type == "cpu":
        resource.setrlimit(resource.RLIMIT_AS, (int(cap_gb * 2**30),) * 2)
    with PeakMemory(device) as memory, stopwatch(device) as elapsed:
        output, status = attempt(lambda: generation(mode, subject, ids, args.new_tokens), device)
    load = os.getloadavg()[0]  # read now: the check below is not part of the run
    if status == OUT_OF_MEMORY and cap_gb and device.type == "cpu":
        status += f" under a {cap_gb:g} GB cap"
    row = dict(mode=mode, tokens=length, seconds=elapsed.seconds, peak_mb=memory.peak_mb, extra_mb=memory.extra_mb,
               status=status, new_ids=new_ids(output, ids.shape[1]), load_1min=load)
    if args.check_exact and mode == "capture" and output is not None:
        print(json.dumps(row), flush=True)  # the measurement stands even if the check then crashes
        row.update(check_exact(output, args))
    return row


# ---- exactness of long traces ------------------------------------------------------------------------------
def sampled_rows(prompt_len: int, n_tokens: int, rows: int, blocks: int, seed: int) -> torch.Tensor:
    """(k,) sorted query positions: `blocks - 2` blocks of `rows` consecutive prompt rows at random starts, the last
    `rows` prompt rows, and the generated rows (at most `rows` of them)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max(1, prompt_len - 2 * rows), (max(0, blocks - 2),), generator=generator)
    picked = [torch.arange(start, start + rows) for start in starts.tolist()]
    picked += [torch.arange(max(0, prompt_len - rows), prompt_len),
               torch.arange(prompt_len, min(n_tokens, prompt_len + rows))]
    return torch.cat(picked).unique()  # sorted; a random block may overlap another


def reference_probs(query: torch.Tensor, key: torch.Tensor, settings: AttentionSettings,
                    rows: torch.Tensor) -> torch.Tensor:
    """Attention probabilities (heads, len(rows), n_tokens) in float64, from the softmax definition alone.

    query: (heads, n_tokens, head_dim) and key: (kv_heads, n_tokens, head_dim), post-RoPE (a trace's); rows: (k,)
    positions. Row p sees keys j <= p, in a layer with sliding window w only those with j > p - w (transformers'
    sliding mask); logits are q.k * scaling, soft-capped to c * tanh(logits / c) where the layer has a cap c.
    """
    heads, kv_heads = query.shape[0], key.shape[0]
    kv_of_head = torch.arange(heads) // (heads // kv_heads)  # GQA: query head h reads KV head h // group size
    q = query[:, rows].double()  # (heads, k, head_dim)
    k = key.double()[kv_of_head.to(key.device)]  # (heads, n_tokens, head_dim)
    logits = q @ k.transpose(1, 2) * settings.scaling  # (heads, k, n_tokens)
    if settings.softcap is not None:
        logits = settings.softcap * torch.tanh(logits / settings.softcap)
    logits = logits.masked_fill(~visible_keys(settings, rows, key.shape[1]), float("-inf"))
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # every row sees itself: the max is finite
    return weights / weights.sum(dim=-1, keepdim=True)


def visible_keys(settings: AttentionSettings, rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """(len(rows), n_tokens) bool: the keys each row may attend to (causal, and within a sliding window)."""
    columns, positions = torch.arange(n_tokens), rows[:, None]
    visible = columns <= positions
    if settings.sliding_window is not None:
        visible &= columns > positions - settings.sliding_window
    return visible


def checked_layers(trace: AttentionTrace) -> dict[str, list[int]]:
    """{"sliding": [first, last], "global": [first, last]}: model layers of each kind the trace recorded."""
    kinds: dict[str, list[int]] = {"sliding": [], "global": []}
    for layer, settings in zip(trace.layers, trace.attention_settings):
        kinds["global" if settings.sliding_window is None else "sliding"].append(layer)
    return {kind: sorted({layers[0], layers[-1]}) for kind, layers in kinds.items() if layers}


def eager_prefix_diff(trace: AttentionTrace, args: argparse.Namespace, n: int) -> list[float]:
    """Per recorded layer, the largest |trace - eager output_attentions| over every head and entry of the first n
    tokens' maps.

    A fresh eager model reads the first n tokens alone: causal attention makes their maps the same as in the
    long run, so this checks the stored queries and keys against the model itself, not only the recompute.
    """
    eager = load_subject(args, attn="eager")
    ids = trace.token_ids[None, :n].to(args.device)
    with torch.inference_mode():
        maps = eager.model(ids, output_attentions=True).attentions  # each (1, heads, n, n)
    return [float((trace.attention(layer, queries=slice(0, n), keys=slice(0, n)).cpu()
                   - maps[layer][0].float().cpu()).abs().max()) for layer in trace.layers]


def check_exact(trace: AttentionTrace, args: argparse.Namespace) -> dict:
    """Exactness of a trace on sampled blocks (see the module's docstring); max abs differences, float."""
    # Seeded by the length: a length's blocks are the same on every run.
    rows = sampled_rows(trace.prompt_len, trace.n_tokens, args.check_rows, args.check_blocks, seed=trace.prompt_len)
    result = dict(rows_checked=int(rows.numel()), max_row_sum_error=0.0, max_hidden_weight=0.0)
    for kind, layers in checked_layers(trace).items():
        result[f"{kind}_layers"] = layers
        result[f"{kind}_max_diff"] = 0.0
        for layer in layers:
            entry = trace.layers.index(layer)
            settings = trace.attention_settings[entry]
            probs = trace.attention(layer, queries=rows).cpu().double()  # (heads, k, n_tokens), float32 values
            expected = reference_probs(trace.queries[entry].cpu(), trace.keys[entry].cpu(), settings, rows)
            hidden = ~visible_keys(settings, rows, trace.n_tokens)
            result[f"{kind}_max_diff"] = max(result[f"{kind}_max_diff"], float((probs - expected).abs().max()))
            result["max_row_sum_error"] = max(result["max_row_sum_error"], float((probs.sum(-1) - 1).abs().max()))
            if hidden.any():  # only a last row of a full-attention layer sees every key
                result["max_hidden_weight"] = max(result["max_hidden_weight"], float(probs[:, hidden].abs().max()))
    n = min(args.check_eager_prefix, trace.prompt_len)
    result["eager_prefix_tokens"] = n
    # The first layer sees the same inputs under both backends, so its maps differ only by the attention arithmetic;
    # deeper layers also inherit the backends' rounding of every earlier layer's output (large in bf16: 0.15 at
    # layer 31 of a random 8B model, docs/performance.md), which is no error of the capture.
    diffs = eager_prefix_diff(trace, args, n) if n else [float("nan")]
    result["eager_prefix_first_layer_diff"], result["eager_prefix_max_diff"] = diffs[0], max(diffs)
    return result


def measure(mode: str, length: int) -> dict:
    """One row, measured in a fresh process that gets this command line's options."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", mode, str(length)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
    if lines:
        row = json.loads(lines[-1])
        if done.returncode:  # only --check-exact runs after the measurement's row is printed
            row["status"] += f"; --check-exact crashed (exit {done.returncode})"
        return row
    return dict(mode=mode, tokens=length, seconds=float("nan"), peak_mb=float("nan"), extra_mb=float("nan"),
                status=f"crashed (exit {done.returncode})", new_ids=[], load_1min=os.getloadavg()[0])


# Columns of --check-exact, in the table's words.
EXACTNESS_COLUMNS = {
    "sliding_max_diff": "max abs diff sliding", "global_max_diff": "max abs diff global",
    "rows_checked": "rows checked per layer", "max_row_sum_error": "max abs(row sum - 1)",
    "max_hidden_weight": "max weight on hidden keys", "eager_prefix_tokens": "eager prefix tokens",
    "eager_prefix_first_layer_diff": "max abs diff vs eager on prefix, first layer",
    "eager_prefix_max_diff": "max abs diff vs eager on prefix, any layer",
}


def same_tokens(rows: pd.DataFrame) -> pd.Series:
    """Per row: "yes" where its new tokens equal plain generate's at the same length, "no", or "" (no generate row,
    or a failed run)."""
    generated = rows[(rows["mode"] == "generate") & (rows["status"] == "ok")].set_index("tokens")["new_ids"]
    runs = zip(rows["tokens"], rows["new_ids"], rows["status"])
    return pd.Series([("yes" if ids == generated[tokens] else "no") if tokens in generated.index and status == "ok"
                      else "" for tokens, ids, status in runs], index=rows.index)


def table(rows: list[dict], attn: str, memory_kind: str) -> pd.DataFrame:
    rows = pd.DataFrame(rows)
    generate_s = rows[rows["mode"] == "generate"].set_index("tokens")["seconds"]
    capture_mb = rows[rows["mode"] == "capture"].set_index("tokens")["extra_mb"]
    out = pd.DataFrame({
        "prompt tokens": rows["tokens"],
        "run": rows["mode"].map(labels(attn)),
        "wall s": rows["seconds"],
        "x plain generate": rows["seconds"] / rows["tokens"].map(generate_s),
        f"peak {memory_kind} MB": rows["peak_mb"],
        "extra over loaded model MB": rows["extra_mb"],
        "x capture extra": rows["extra_mb"] / rows["tokens"].map(capture_mb),
        "new tokens": rows["new_ids"].map(len),
        "same tokens as plain generate": same_tokens(rows),
        "load avg 1 min": rows["load_1min"],
        "status": rows["status"],
    })
    for key, column in EXACTNESS_COLUMNS.items():
        if key in rows:
            out[column] = rows[key]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--eager-cap-gb", type=float, default=16.0, help="address-space cap of eager runs on CPU")
    parser.add_argument("--cap-gb", type=float, help="address-space cap of generate and capture runs on CPU (default "
                        "none; on a shared machine a run then fails cleanly instead of waking the OOM killer)")
    parser.add_argument("--check-exact", action="store_true",
                        help="check each capture's trace on sampled blocks against float64 and eager (see above)")
    parser.add_argument("--check-rows", type=int, default=64, help="query rows per checked block")
    parser.add_argument("--check-blocks", type=int, default=4, help="blocks checked per layer (2 of them fixed)")
    parser.add_argument("--check-eager-prefix", type=int, default=1024,
                        help="prompt tokens whose maps are compared with eager output_attentions (0: none)")
    add_model_options(parser)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parse_model_options(parser)
    if args.child:
        mode, length = args.child
        print(json.dumps(child(args, mode, int(length))))
        return

    rows, out_of_memory = [], {}
    for length in sorted(args.lengths):
        for mode in args.modes:
            if mode in out_of_memory:  # a longer prompt needs more: don't spend a model load on a known failure
                rows.append(dict(mode=mode, tokens=length, seconds=float("nan"), peak_mb=float("nan"),
                                 extra_mb=float("nan"), new_ids=[], load_1min=os.getloadavg()[0],
                                 status=f"{OUT_OF_MEMORY} (not run: it did at {out_of_memory[mode]} tokens)"))
            else:
                rows.append(measure(mode, length))
                if rows[-1]["status"].startswith(OUT_OF_MEMORY):
                    out_of_memory[mode] = length
            row = rows[-1]
            print(f"  {length:>5} {mode:<9} {row['seconds']:7.1f} s  peak {row['peak_mb']:8.0f} MB  {row['status']}",
                  file=sys.stderr, flush=True)
            if "rows_checked" in row:
                print("        exactness: " + ", ".join(f"{key} {row[key]}" for key in row
                                                        if key.endswith(("_layers", "_diff", "_error", "_weight"))),
                      file=sys.stderr, flush=True)
    memory_kind = PeakMemory(args.device).kind
    formats = {"wall s": ".1f", "x plain generate": ".2f", f"peak {memory_kind} MB": ".0f",
               "extra over loaded model MB": ".0f", "x capture extra": ".1f", "load avg 1 min": ".2f",
               "rows checked per layer": ".0f", "eager prefix tokens": ".0f"}
    report(table(rows, args.attn, memory_kind), result_name("capture", args), formats=formats,
           title=f"prompt + {args.new_tokens} generated tokens, {describe(args)}")


if __name__ == "__main__":
    main()
