"""The eval path of `snapkv-lab eval` on a CUDA GPU, the way a user with an 8B model runs it: the model loaded from a
folder by `load_model`'s defaults there (bfloat16, sdpa, on the GPU), one generated RULER example through the full
cache and every policy at one ratio (`run_example`, a few policies per call, as `evaluate`'s cells run them: sdpa
without cuDNN unless --cudnn), one mode at a time. The weights are random (nothing can be downloaded on a lent GPU, and
real weights do not fit its 64 MiB tree), so the scores are noise: the run checks that every policy answers in bf16
on CUDA, keeps its budget, and times each row (prefill, selection, decode per token) at a real model's shape.

Two steps, because the device machine has no bundled model:
    python scripts/gpu_eval_check.py prepare .gpu/tokenizer          (here: the bundled SmolLM2 tokenizer, 2 MB)
    python scripts/gpu_eval_check.py run .gpu/tokenizer --out DIR     (there: the random model, then the runs)

The random model has Llama-3-8B's shape (benchmarks/_common.py) with the tokenizer's vocabulary, so that every
generated id decodes. HeadKV and DuoAttention are left out by default: they rank heads by retrieval scores measured
on Paul Graham's essays, which a random model cannot copy (they refuse it) and the device machine does not have.
Writes <out>/eval_gpu_<mode>.csv per mode (rewritten as each group ends) and prints a table per group; exits 1 if a
row is missing or a compressed row kept as many tokens as its prompt.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's package; _common's shapes and tables
COLUMNS = ["policy", "ratio", "mode", "prompt_tokens", "kept_tokens", "prefill_s", "selection_s",
           "decode_ms_per_token", "new_tokens"]


def prepare(folder: Path, model: str | None) -> None:
    from snapkv_lab.core.models import load_tokenizer

    load_tokenizer(model).save_pretrained(folder)
    print(f"saved the tokenizer of {model or 'the default bundled model'} in {folder}")


def random_model_folder(tokenizer_folder: Path, shape: str, folder: Path) -> Path:
    """A folder `load_model` reads: random weights of `shape` (seeded; bf16, built on the GPU where there is one, as
    load_model will place them) with the tokenizer's vocabulary. A folder that already holds a model is read back,
    and refused unless its config has that shape and vocabulary."""
    import json

    import torch
    from _common import RANDOM_SHAPES
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    settings = {**RANDOM_SHAPES[shape], "vocab_size": len(tokenizer)}
    if (folder / "config.json").exists():
        saved = json.loads((folder / "config.json").read_text())
        differ = {key: (saved.get(key), value) for key, value in settings.items() if saved.get(key) != value}
        if differ:
            raise SystemExit(f"gpu_eval_check: {folder} holds a model of another shape than {shape} (saved, wanted: "
                             f"{differ}); pass another --model-folder")
        return folder
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def run(args) -> int:
    import pandas as pd
    from _common import markdown

    import snapkv_lab
    from snapkv_lab.core.models import load_model
    from snapkv_lab.evaluation import eval_cells, run_example
    from snapkv_lab.sweep.executors import many_shapes_attention

    policies = [name for name in args.policies or snapkv_lab.POLICIES if name != "FullCache" and name not in args.skip]
    groups = [policies[i:i + args.group] for i in range(0, len(policies), args.group)]
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        start = time.perf_counter()
        folder = str(random_model_folder(args.tokenizer, args.shape, args.model_folder or Path(scratch) / "model"))
        model, tokenizer = load_model(folder)
        print(f"random {args.shape}-shape model ready and loaded in {time.perf_counter() - start:.0f} s "
              f"({model.device}, {model.dtype}, sdpa {'with' if args.cudnn else 'without'} cuDNN)", flush=True)
        for mode in args.modes:
            parts = []
            for group in groups:  # a group's rows are printed and saved as it ends: a run cut short keeps them
                [cell] = eval_cells(folder, ["ruler"], [args.task], group, ratios=[args.ratio], modes=[mode], limit=1,
                                    lengths=[args.length])
                start = time.perf_counter()
                with nullcontext() if args.cudnn else many_shapes_attention(model):
                    table = run_example(model, tokenizer, cell.config)
                seconds = time.perf_counter() - start
                parts.append(table if not parts else table[table["mode"] != "full"])
                pd.concat(parts).to_csv(args.out / f"eval_gpu_{mode}.csv", index=False)
                print(f"\n{args.task}, {args.length} tokens, {mode}, ratio {args.ratio}: {', '.join(group)} "
                      f"(and the full cache) in {seconds:.0f} s\n", flush=True)
                print(markdown(table[COLUMNS]), flush=True)
            table = pd.concat(parts)
            missing = sorted(set(policies) - set(table.policy))
            full = table[table["mode"] == "full"]
            squeezed = table[(table["mode"] != "full") & (table.kept_tokens >= table.prompt_tokens)]
            if missing or len(full) != 1 or len(squeezed):
                print(f"gpu_eval_check: {mode}: missing {missing}, full-cache rows {len(full)}, compressed rows that "
                      f"kept the whole prompt {squeezed.policy.tolist()}", file=sys.stderr)
                failed = True
    return int(failed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    p = steps.add_parser("prepare", help="save the tokenizer (here)")
    p.add_argument("folder", type=Path)
    p.add_argument("--model", help="a bundled model's name (default SmolLM2-135M-Instruct)")
    r = steps.add_parser("run", help="the random model and the eval runs (on the GPU)")
    r.add_argument("tokenizer", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--shape", default="llama3-8b")
    r.add_argument("--scratch", help="folder of the saved model and the cell store (default the system's temp "
                                     "folder; /dev/shm keeps the 8B shape's 15 GB in memory)")
    r.add_argument("--model-folder", type=Path, help="where the random model is saved, and read back by a later run "
                                                     "instead of building it again (refused if its shape is not "
                                                     "--shape; default: a temporary folder under --scratch)")
    r.add_argument("--task", default="niah_single_1")
    r.add_argument("--length", type=int, default=4096)
    r.add_argument("--ratio", type=float, default=0.5)
    r.add_argument("--modes", nargs="+", default=["query-agnostic", "query-aware"])
    r.add_argument("--policies", nargs="+", help="registered policies by name (default: every compressor)")
    r.add_argument("--skip", nargs="*", default=["HeadKV", "DuoAttention"])
    r.add_argument("--group", type=int, default=4, help="policies per run_example call (each also answers with the "
                                                        "full cache; the first call's full-cache row is kept)")
    r.add_argument("--cudnn", action="store_true", help="leave sdpa's cuDNN backend on, as torch chooses (evaluate "
                                                        "turns it off on CUDA: snapkv_lab.sweep.executors)")
    args = parser.parse_args(argv)
    if args.step == "prepare":
        prepare(args.folder, args.model)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
