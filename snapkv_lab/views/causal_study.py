"""Every policy against the causal oracle: on needle prompts the full cache answers, each registered policy's kept set
at one compression ratio, in both modes, scored on the causal side (`causal_coverage`) and on the attention side
(`attention_coverage` over the same context positions).

    python -m snapkv_lab.views.causal_study --prompts 8 --length 1024        # data/causal_coverage.csv (resumes)
    snapkv-lab figures --recompute --only causal                            # the same, then its figures

Per prompt (a needle in Paul Graham's essays, tasks.needles.needle_context) and mode:
- the span effects of every block of the context (span_effects: the context alone prefilled and the question fed
  after it, query-agnostic; or the context and question prefilled together, query-aware, where the answer's first
  token follows the prefill and no eviction changes it), for the full cache's greedy answer;
- one full-cache trace of the context and question with the answer teacher-forced (both modes share it): the
  attention the answer's rows pay the context's positions (renormalised over the context, the question's positions
  being no policy's to evict);
- every policy compresses the prompt of its mode (the context alone, or the context and question) from one shared
  prefill, answers greedily, and its kept mask over the context's positions (layers x KV heads) is scored: causal
  coverage, oracle and chance (views.causal), attention coverage, oracle and chance (views.coverage, sinks kept, and
  sinks excluded beside), the needle's kept share.
One row per (prompt, mode, policy) in the tidy table TABLE, the span effects of each (prompt, mode) in EFFECTS; a
prompt's rows are written as soon as it is done, and a rerun skips the (prompt, mode, policy) rows stored (a policy
added later runs alone on the prompts already done).

A model with sliding-window layers (Gemma 3: 15 of 18, window 512) is scored on its compressed layers only
(`scored_layers`): a sliding layer's cache holds the last sliding_window - 1 positions under every policy and under
the full cache alike (compressors leave it whole), so its entries are no policy's choice, and a context span before
them is not there to evict. There the spans are evicted from the compressed layers alone, and the kept masks and the
attention side are read over those layers; a span inside the window stays in the sliding layers, as it does under
every policy. Scored over every layer instead, an early span's kept share would be capped at the compressed layers'
share (3/18 on Gemma) even under the full cache, and the causal oracle would fill entries no cache holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from datetime import date
from pathlib import Path

import pandas as pd
import torch

from ..compression import SharedPrefill
from ..compression.generation import MODES, answer
from ..compression.kept import kept_mask
from ..compression.span_effects import EvictionProbe, default_spans, probe_spans
from ..core.capture import capture
from ..core.models import load_model, sliding_layers
from ..core.models import model_name as name_of
from ..core.progress import progress_bar
from ..policies import expand_policies, parse_policy
from ..tasks.corpus import redact_essays
from ..tasks.needles import found, needle_context
from .causal import causal_coverage
from .coverage import GenerationAttention, attention_coverage, coverage_summary

TABLE = "causal_coverage.csv"
EFFECTS = "causal_effects.csv"
RUN = "causal_coverage_run.json"
RATIO = 0.5
# A policy whose registry default cannot run without weights the lab does not ship for every model is run in the
# variant it ships: KVzap's linear surrogate is committed for both bundled models, its MLP is not.
SHIPPED_VARIANTS = {"KVzap": "KVzap(model_type='linear')"}
COLUMNS = ["model", "prompt", "length", "depth", "needle_start", "needle_end", "mode", "policy", "ratio",
           "full_answer", "full_correct", "answer", "correct", "kept_entries", "context_entries", "coverage", "oracle",
           "chance", "total_effect", "needle_effect", "attention_coverage", "attention_oracle", "attention_chance",
           "attention_coverage_no_sinks", "needle_kept"]


def read_table(path) -> pd.DataFrame:
    """The study's table as written: answers stay text (a 7-digit answer would otherwise read back as a number)."""
    return pd.read_csv(path, dtype={"full_answer": str, "answer": str})


def study_policies(model, tokenizer, names=("all",), ratio: float = RATIO) -> tuple[list, dict]:
    """(policies built at capacity 1 - ratio and prepared for the model, {name: why skipped}): a policy that cannot
    run on this model (trained weights absent) is left out with its reason, not silently."""
    policies, skipped = [], {}
    for name in expand_policies(list(names)):
        try:
            policy = dataclasses.replace(parse_policy(SHIPPED_VARIANTS.get(name, name)),
                                         capacity=round(1 - ratio, 10))
            policy.prepare(model, tokenizer)
        except (ValueError, FileNotFoundError) as error:
            skipped[name] = str(error).split(":")[0]
            continue
        policies.append(policy)
    return policies, skipped


def scored_layers(model) -> list[int] | None:
    """The layers the study scores (module doc): those a policy compresses, or None (every layer) where no layer
    slides."""
    sliding = set(sliding_layers(model))
    if not sliding:
        return None
    scored = [i for i in range(model.config.get_text_config().num_hidden_layers) if i not in sliding]
    if not scored:
        raise ValueError("every layer of the model slides: no layer a policy compresses is left to score")
    return scored


def _needle_effect(effects: pd.DataFrame, span: tuple[int, int]) -> float:
    """The share of the total KL in the blocks that overlap the needle."""
    overlaps = (effects.start < span[1]) & (effects.end > span[0])
    total = effects.kl.sum()
    return float(effects.kl[overlaps].sum() / total) if total > 0 else float("nan")


@torch.inference_mode()
def prompt_cells(model, tokenizer, prompt: int, policies, *, length: int, depth: float, block: int = 64,
                 modes=MODES, ratio: float = RATIO, max_new_tokens: int = 12, model_name: str = "") -> tuple:
    """(rows, effects) of one needle prompt (sample `prompt`) in each of `modes` (module doc): rows one per (mode,
    policy), the full cache's first; effects the span_effects table of each mode, with prompt and mode columns.
    Every side reads the scored_layers only (module doc)."""
    layers = scored_layers(model)
    context = needle_context(tokenizer, length, depth, sample=prompt)
    query = context.queries[0]
    ids, question = torch.tensor([context.context_ids]), torch.tensor([query.question_ids])
    n = ids.shape[1]
    probes = {}
    for mode in modes:  # the first probe's greedy answer (the full cache's) is the answer of both
        first = next(iter(probes.values()), None)
        probes[mode] = EvictionProbe.prefilled(
            model, tokenizer, ids, query.question_ids, answer=None if first is None else first.answer[0],
            query_aware=mode == "query-aware", max_new_tokens=max_new_tokens)
    answer_ids = next(iter(probes.values())).answer
    full_answer = tokenizer.decode(answer_ids[0], skip_special_tokens=True)
    prompt_ids = torch.cat([ids, question], 1)
    trace = capture(model, tokenizer, prompt_ids, continuation=answer_ids[0], layers=layers, progress=False)
    attention = GenerationAttention(trace, context=n)
    base = dict(model=model_name, prompt=prompt, length=length, depth=depth, needle_start=query.span[0],
                needle_end=query.span[1], ratio=ratio, full_answer=redact_essays(full_answer),
                full_correct=found(query.answer, full_answer))
    rows, tables = [], []
    for mode, probe in probes.items():
        effects = probe_spans(probe, default_spans(n, block), layers=layers, progress=False)
        tables.append(effects.assign(prompt=prompt, mode=mode))
        shared = SharedPrefill.run(model, tokenizer, ids if mode == "query-agnostic" else prompt_ids, policies)
        for policy in policies:
            state = shared.state(policy)
            # the context's positions held; query-agnostic, the question is appended whole after compression
            held = kept_mask(state, prompt_ids.shape[1], whole_from=n if mode == "query-agnostic" else None)
            if layers is not None:  # the compressed layers only (module doc)
                held = held[layers]
            run = answer(model, tokenizer, state, shared.logits if mode == "query-aware" else None, shared.ids,
                         [None], [question if mode == "query-agnostic" else None], prefill_seconds=0.0,
                         max_new_tokens=max_new_tokens, mode=mode)[0]
            rows.append(dict(base, mode=mode, policy=policy.label, answer=redact_essays(run.text),
                             correct=found(query.answer, run.text), **_scores(effects, held, attention, n, query.span)))
    return rows, pd.concat(tables, ignore_index=True)


def _scores(effects: pd.DataFrame, held: torch.Tensor, attention: GenerationAttention, n: int, span) -> dict:
    """A kept mask (layers, rows, prompt) scored on both sides over the context's n positions."""
    causal = causal_coverage(effects, held[..., :n], n_tokens=n)
    table = attention_coverage(attention, held).assign(policy="")
    kept, excluded = coverage_summary(table, sinks="kept").iloc[0], coverage_summary(table, sinks="excluded").iloc[0]
    return dict(kept_entries=int(held[..., :n].sum()), context_entries=int(held[..., :n].numel()),
                coverage=causal["coverage"], oracle=causal["oracle"], chance=causal["chance"],
                total_effect=causal["total_effect"], needle_effect=_needle_effect(effects, span),
                attention_coverage=kept.coverage, attention_oracle=kept.oracle, attention_chance=kept.chance,
                attention_coverage_no_sinks=excluded.coverage,
                needle_kept=float(held[..., span[0]:span[1]].float().mean()))


def run_study(model_name: str | None = None, data_dir="data", *, threads: int | None = None, **settings
              ) -> pd.DataFrame:
    """Load a bundled model (None: the default) and run or resume `study` on it into data_dir."""
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    return study(model, tokenizer, data_dir, model_name=name_of(model_name), **settings)


def study(model, tokenizer, data_dir="data", *, model_name: str = "", prompts: int = 8, length: int = 1024,
          depths=(0.25, 0.5, 0.75), block: int = 64, policies=("all",), ratio: float = RATIO, modes=MODES,
          max_new_tokens: int = 12, progress: bool = True) -> pd.DataFrame:
    """Run (or resume) the study into data_dir: TABLE and EFFECTS, one prompt's cells at a time (a (prompt, mode) cell
    stored is skipped), and RUN (its settings, the policies skipped, the date and the machine's load). Prompt i is
    needle sample i, its needle at depths[i % len(depths)]. Returns the whole table."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    built, skipped = study_policies(model, tokenizer, policies, ratio)
    if not built:
        raise ValueError(f"no policy of {list(policies)} can run on this model: {skipped}")
    table_path, effects_path = data_dir / TABLE, data_dir / EFFECTS
    stored = read_table(table_path) if table_path.exists() else pd.DataFrame(columns=COLUMNS)
    done = set(zip(stored.prompt, stored["mode"], stored.policy, strict=True))
    record = dict(command=f"python -m snapkv_lab.views.causal_study --model {model_name} --prompts {prompts} "
                          f"--length {length} --block {block} --ratio {ratio} --policies {' '.join(policies)}",
                  date=date.today().isoformat(), model=model_name, prompts=prompts, length=length,
                  depths=list(depths), block=block, ratio=ratio, modes=list(modes),
                  scored_layers=scored_layers(model), policies=[p.label for p in built],
                  skipped=skipped, load_average=[round(os.getloadavg()[0], 1)], cpu_count=os.cpu_count())
    started = time.perf_counter()
    for prompt in progress_bar(range(prompts), desc="causal coverage", total=prompts, disable=not progress):
        # a policy added to a finished study runs alone on the stored prompts (their span effects are recomputed,
        # deterministically, and kept once)
        todo = [mode for mode in modes if any((prompt, mode, p.label) not in done for p in built)]
        if not todo:
            continue
        missing = [p for p in built if any((prompt, mode, p.label) not in done for mode in todo)]
        rows, effects = prompt_cells(model, tokenizer, prompt, missing, length=length,
                                     depth=depths[prompt % len(depths)], block=block, modes=todo, ratio=ratio,
                                     max_new_tokens=max_new_tokens, model_name=model_name)
        rows = [row for row in rows if (prompt, row["mode"], row["policy"]) not in done]
        stored = pd.concat([stored, pd.DataFrame(rows, columns=COLUMNS)], ignore_index=True)
        stored.to_csv(table_path, index=False)
        old = pd.read_csv(effects_path) if effects_path.exists() else None
        merged = pd.concat([old, effects], ignore_index=True).drop_duplicates(["prompt", "mode", "start", "end"])
        merged.to_csv(effects_path, index=False)
        # the record after every prompt, so that a run stopped part way says what it ran and under what load
        record.update(prompts_done=int(stored.prompt.nunique()), seconds_this_run=round(time.perf_counter() - started))
        record["load_average"].append(round(os.getloadavg()[0], 1))
        (data_dir / RUN).write_text(json.dumps(record, indent=1) + "\n")
    return stored


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a bundled model (default SmolLM2-135M-Instruct)")
    parser.add_argument("--data-dir", default=None, help="default data/ (data/<model>/ for another model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--ratio", type=float, default=RATIO)
    parser.add_argument("--policies", nargs="+", default=["all"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    from ..core.figure_files import model_folders

    data_dir = args.data_dir or model_folders("data", "figures", args.model)[0]
    run_study(args.model, data_dir, threads=args.threads, prompts=args.prompts, length=args.length,
              block=args.block, policies=args.policies, ratio=args.ratio)


if __name__ == "__main__":
    main()
