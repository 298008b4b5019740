"""kvpress's evaluation files, both ways: a lab run written as kvpress's `evaluate.py` writes its results (what its
public leaderboard takes: "copy the output directory in the huggingface space"), and kvpress's results read back as
task scores to draw beside the lab's.

    written = export_kvpress(read_results("data/eval_ruler.csv"), "out/kvpress")   # one folder per press x ratio x mode
    scores = read_kvpress("out/kvpress")       # per (model, dataset, length, task, policy, ratio, mode): score, 0-100

The format, transcribed from NVIDIA/kvpress at commit 8bb29b9 (2026-08-06), folder evaluation/:
- One folder per run, named by `EvaluationConfig.get_results_dir` (evaluate.py:126-149): dataset, data_dir, the
  model with "/" as "--", press_name and f"{compression_ratio:.2f}" joined by "__", then "query_aware" where the
  question was compressed with the context. Its three files: predictions.csv, metrics.json, config.yaml (506-508).
- config.yaml: `asdict(EvaluationConfig)` (fields at 42-78) dumped by `save_config` (163-175): yaml, keys in field
  order (sort_keys=False); threshold and head_compression_ratio dropped where None, compression_ratio dropped where
  either is set (kvzap's threshold, DuoAttention's head ratio).
- predictions.csv: every column of the dataset but the context (472), plus predicted_answer (408) and
  compression_ratio (453, 0.0 for no_press). kvpress's RULER has the columns question, answer_prefix, answer (the
  list of references), task, max_new_tokens (benchmarks/ruler/create_huggingface_dataset.py:70-71). A query-aware
  run appends the question to the context and blanks the question (evaluate.py:352-355).
- metrics.json: RULER's scorer (benchmarks/ruler/calculate_metrics.py:30-43): {task: {"string_match": score}}, the
  mean over the task's rows of string_match_all (qa tasks: string_match_part) on the prediction stripped of control
  characters, x 100, rounded to 2 decimals.
- The full cache is press_name "no_press" at compression_ratio 0.0, without the question (leaderboard.sh:13).

What a lab table cannot fill: the question's and answer prefix's texts (the table keeps each example's spec, from
which evaluation.explain rebuilds them, not its text): both columns are written empty, as kvpress's own query-aware
runs leave the question. The examples are the lab's RULER, generated here (seed in config.yaml), not the rows of
kvpress's simonjegou/ruler; `fraction` stays 1.0 (kvpress draws a random share; a lab run's --limit takes the first
examples: predictions.csv holds them); a run of `--dataset ruler-hub` answers kvpress's own rows. Only RULER runs
(ruler, ruler-hub) at compression ratios are written: kvpress scores each set with a scorer of its own, and counts
budgets as ratios alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from .ruler import CONFIGS, TEMPLATES

KVPRESS_COMMIT = "8bb29b9c3078452a86d692f29123fa6c793e2b05"
FILES = ("config.yaml", "metrics.json", "predictions.csv")
NO_PRESS = "no_press"
METRIC = "string_match"
# predictions.csv's columns in the order written (kvpress writes `set(columns) - {"context"}`, in no fixed order).
PREDICTION_COLUMNS = ("question", "answer_prefix", "answer", "task", "max_new_tokens", "predicted_answer",
                      "compression_ratio")
# EvaluationConfig's fields in order, with their defaults (evaluate.py:42-78).
CONFIG_FIELDS = dict(dataset="ruler", data_dir=None, model="meta-llama/Meta-Llama-3.1-8B-Instruct", device=None,
                     press_name="knorm", compression_ratio=1.0, key_channel_compression_ratio=None,
                     head_compression_ratio=None, threshold=None, fraction=1.0, max_new_tokens=None,
                     max_context_length=None, query_aware=False, needle_depth=None, compression_interval=None,
                     target_size=None, hidden_states_buffer_size=None, output_dir="./results", log_level="INFO",
                     model_kwargs=None, press_init_command=None, seed=42, fp8=False)
# The lab's RULER (generated here) and kvpress's own rows of it (simonjegou/ruler): both are kvpress's "ruler".
RULERS = ("ruler", "ruler-hub")
SCORES = ["model", "dataset", "length", "task", "policy", "ratio", "mode", "score", "examples"]


def _control_free(prediction: str) -> str:
    # calculate_metrics.py:33-34: control characters removed (RULER's own scripts turn them into newlines).
    return re.sub(r"[\x00-\x1f]", "", prediction.strip()).strip()


def string_match(task: str, prediction: str, references) -> float:
    """kvpress's RULER score of one row, 0-100 (calculate_metrics.py:10-27): qa tasks, 100 if any reference is in the
    prediction; the others, the share of references found (case-insensitive substrings of the prediction without
    its control characters)."""
    found = _control_free(prediction).lower()
    hits = [reference.lower() in found for reference in references]
    return 100.0 * (max(hits) if task.split("_")[0] == "qa" else sum(hits) / len(hits))


def metrics(predictions: pd.DataFrame) -> dict:
    """metrics.json of predictions.csv's rows (answer: each row's references as a sequence): {task: {"string_match":
    the mean over its rows, rounded to 2 decimals}}, tasks sorted as kvpress's groupby sorts them."""
    scores = [string_match(t, p, a) for t, p, a in zip(predictions.task, predictions.predicted_answer,
                                                         predictions.answer)]
    means = pd.Series(scores, index=predictions.task.to_numpy(), dtype=float).groupby(level=0).mean()
    return {task: {METRIC: round(float(score), 2)} for task, score in means.items()}


def folder_name(config: dict) -> str:
    """get_results_dir's name of a run's folder (evaluate.py:126-149; the fields a lab run sets)."""
    step = config.get("threshold", config.get("head_compression_ratio", config.get("compression_ratio")))
    parts = [config["dataset"], str(config["data_dir"] or ""), config["model"].replace("/", "--"), config["press_name"],
             f"{step:.2f}"]
    if config["query_aware"]:
        parts.append("query_aware")
    return "__".join(part for part in parts if part)


def _config(model: str, length, policy: str, ratio: float, query_aware: bool, policy_config: str, seed,
            out_dir: Path) -> dict:
    """config.yaml's mapping for one folder: kvpress's fields in order, as save_config keeps them."""
    config = dict(CONFIG_FIELDS, dataset="ruler", data_dir=str(int(length)), model=model, press_name=policy,
                  compression_ratio=float(ratio), query_aware=bool(query_aware), output_dir=str(out_dir),
                  model_kwargs={}, press_init_command=f"snapkv_lab {policy_config}", seed=int(seed))
    del config["head_compression_ratio"], config["threshold"]  # save_config drops them where None (170-173)
    return config


def check_exportable(datasets, capacities: bool = False, policies=()) -> None:
    """Refuse a run kvpress's format cannot hold, saying why: another set than RULER, budgets in tokens, a policy
    label that cannot name a folder. Called on a run's options before it runs, and on the table written."""
    others = sorted(set(datasets) - set(RULERS))
    if others:
        raise ValueError(f"kvpress's submission format is written for RULER runs (its leaderboard's set; kvpress "
                         f"scores every set with a scorer of its own), not {', '.join(others)}")
    if capacities:
        raise ValueError("kvpress counts budgets as compression ratios: this run's budgets are capacities in tokens "
                         "(run it with --ratios)")
    slashed = sorted(str(p) for p in set(policies) if "/" in str(p))
    if slashed:
        raise ValueError(f"a policy label with '/' cannot name a kvpress folder: {slashed}")


def export_kvpress(table: pd.DataFrame, out_dir) -> list[Path]:
    """Write `table` (an `evaluate` table of RULER at compression ratios) as kvpress's results: one folder per
    (model, length, policy, ratio, mode), the full cache once as no_press (module doc). Each press keeps the lab's
    label as press_name (a lab policy is not kvpress's press of a similar name: docs/faithfulness.md says how they
    differ) and its settings in press_init_command. A folder already there is rewritten, not numbered as kvpress
    numbers a rerun's. Returns the folders, sorted."""
    check_exportable(table.dataset, table["capacity"].notna().any(), table.policy)
    out_dir = Path(out_dir)
    written = []
    # kvpress's data_dir: the prompt length (ruler-hub's rows keep it in their spec alone)
    table = table.assign(length=[int(n) if pd.notna(n) else json.loads(spec)["length"]
                                 for n, spec in zip(table.length, table.spec)])
    keys = ["model", "length", "policy", "ratio", "mode"]
    for (model, length, policy, ratio, mode), rows in table.groupby(keys, sort=True, dropna=False):
        full = mode == "full"
        spec = json.loads(rows.spec.iloc[0])
        config = _config(model, length, NO_PRESS if full else policy, 0.0 if full else ratio, mode == "query-aware",
                         rows.policy_config.iloc[0], spec.get("seed", 0), out_dir)
        predictions = pd.DataFrame(dict(
            question="", answer_prefix="",
            # kvpress's answer cells are numpy arrays (the Hub set's list column), written as numpy prints them
            answer=[np.array(json.loads(refs), dtype=object) for refs in rows.references],
            task=rows.task.to_numpy(),
            max_new_tokens=[TEMPLATES[CONFIGS[task].family].tokens_to_generate for task in rows.task],
            predicted_answer=rows.prediction.to_numpy(), compression_ratio=config["compression_ratio"]),
            columns=list(PREDICTION_COLUMNS))
        folder = out_dir / folder_name(config)
        folder.mkdir(parents=True, exist_ok=True)
        predictions.to_csv(folder / "predictions.csv", index=False)
        (folder / "metrics.json").write_text(json.dumps(metrics(predictions), indent=4))
        _write_yaml(folder / "config.yaml", config)
        written.append(folder)
    return sorted(written)


def _write_yaml(path: Path, config: dict) -> None:
    import yaml

    with open(path, "w") as f:  # save_config's call (evaluate.py:175)
        yaml.dump(config, f, default_flow_style=False, indent=2, sort_keys=False)


def result_folders(root) -> list[Path]:
    """Every folder under `root` (itself included) holding kvpress's config.yaml and metrics.json, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder of kvpress results")
    found = sorted({path.parent for path in root.rglob("metrics.json") if (path.parent / "config.yaml").is_file()})
    if not found:
        raise FileNotFoundError(f"{root} holds no kvpress results (folders with config.yaml and metrics.json)")
    return found


def _ratio(config: dict, folder: Path) -> float:
    """The run's compression ratio: config.yaml's, else (a threshold or head-ratio press, whose ratio is measured)
    the mean of predictions.csv's compression_ratio column (evaluate.py:453)."""
    if config.get("compression_ratio") is not None:
        return float(config["compression_ratio"])
    predictions = folder / "predictions.csv"
    if predictions.is_file():
        return float(pd.read_csv(predictions, usecols=["compression_ratio"]).compression_ratio.mean())
    raise ValueError(f"{folder}: config.yaml has no compression_ratio and there is no predictions.csv to measure it")


def read_kvpress(root) -> pd.DataFrame:
    """kvpress's RULER results under `root` (folders as `export_kvpress` writes them and kvpress publishes them) as
    task scores: one row per (model, dataset, length, task, policy, ratio, mode), columns SCORES. no_press reads as
    the lab's full cache (policy FullCache, ratio 0, mode "full"); a press by its press_name, mode "query-aware"
    where query_aware, else "query-agnostic"; score is metrics.json's string_match (0-100); examples, the task's
    rows in predictions.csv (NA where it is absent). Other sets' results are refused by name."""
    import yaml

    rows = []
    for folder in result_folders(root):
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        missing = {"dataset", "model", "press_name"} - set(config)
        if missing:
            raise ValueError(f"{folder}/config.yaml lacks {', '.join(sorted(missing))}: not kvpress's config")
        if config["dataset"] != "ruler":
            raise ValueError(f"{folder}: results of {config['dataset']!r}; only RULER's (the leaderboard's) are read")
        scores = json.loads((folder / "metrics.json").read_text())
        bad = [task for task, value in scores.items() if not isinstance(value, dict) or METRIC not in value]
        if bad:
            raise ValueError(f"{folder}/metrics.json: no {METRIC!r} for {bad}: not kvpress's RULER metrics")
        predictions = folder / "predictions.csv"
        counts = (pd.read_csv(predictions, usecols=["task"]).task.value_counts() if predictions.is_file()
                  else pd.Series(dtype=int))
        full = config["press_name"] == NO_PRESS
        mode = "full" if full else "query-aware" if config.get("query_aware") else "query-agnostic"
        for task, value in scores.items():
            rows.append(dict(model=config["model"], dataset="ruler", length=int(config["data_dir"]), task=task,
                             policy="FullCache" if full else config["press_name"],
                             ratio=0.0 if full else _ratio(config, folder), mode=mode, score=float(value[METRIC]),
                             examples=counts.get(task, pd.NA)))
    return pd.DataFrame(rows, columns=SCORES).astype({"examples": "Int64"})
