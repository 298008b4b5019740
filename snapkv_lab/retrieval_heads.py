"""Which heads retrieve: Wu et al.'s retrieval score of every (layer, query head), measured on the model itself.

    table = retrieval_heads(model, tokenizer)       # one row per (layer, head), pooled over needle prompts
    heads_grid_figure(table, "retrieval_score")     # the layer x head grid (snapkv_lab.heads)

The protocol of the official detection (nightdessert/Retrieval_Head, retrieval_head_detection.py at commit
3ac171a), on the lab's own needles (`pressure.needle_context`: a 7-digit value in Paul Graham's essays, asked for
by its key) instead of the official needle sentences:
    - the model answers each needle prompt greedily (the official decodes up to 50 tokens, lines 235-246);
    - a prompt counts only if the model found the needle (the official keeps answers whose ROUGE-1 recall of the
      needle is above 50, lines 298-300; here the answer must hold the value);
    - in each counted answer, a copy step is an emitted token found in the needle's tokens, and a head hits when
      its top-attended key holds that token inside the needle (`heads.copy_steps` and `heads.retrieval_hits`, as
      `heads.head_table` counts them; lines 221-229).
The score pools the prompts as hits over copy steps (the official averages per-test scores normalised by the
needle's length: the two agree when every answer copies the needle once). Results are cached per model and
settings in the cache folder (`models.cache_dir()`), so a policy built from them (DuoAttention, HeadKV) pays the
captures once per model.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pandas as pd
import torch

from .capture import capture
from .figures import FigureSet, register
from .heads import copy_steps, layer_head_grid, retrieval_hits
from .models import measured_cache_path
from .progress import progress_bar

LENGTHS = (1000, 2000)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
COLUMNS = ["layer", "head", "kv_head", "prompts", "copy_steps", "retrieval_hits", "retrieval_score"]


def retrieval_heads(model, tokenizer, *, lengths=LENGTHS, depths=DEPTHS, samples: int = 1, max_new_tokens: int = 16,
                    found_only: bool = True, cache: bool = True, progress: bool = True) -> pd.DataFrame:
    """One row per (layer, query head): prompts (needle prompts counted), copy_steps and retrieval_hits summed
    over them, retrieval_score = hits / copy steps (NaN with no copy step). Needle prompts: every length x depth x
    sample (`pressure.needle_context`). found_only=False counts every prompt, found or not (not the official
    filter). cache: read and write <cache folder>/retrieval_heads/<model>-<settings hash>.csv."""
    from .pressure.tasks import needle_context  # the pressure suites run HeadKV, which reads these scores: at call time
    settings = dict(model=str(getattr(model.config, "name_or_path", "")), lengths=list(lengths), depths=list(depths),
                    samples=samples, max_new_tokens=max_new_tokens, found_only=found_only)
    path = measured_cache_path("retrieval_heads", model, settings, "csv")
    if cache and path.exists():
        return pd.read_csv(path)
    tables, counted = [], 0  # per counted prompt and layer: copy steps and hits (no other statistic of head_table's)
    specs = [(n, depth, sample) for n in lengths for depth in depths for sample in range(samples)]
    for n, depth, sample in progress_bar(specs, desc="retrieval heads", disable=not progress):
        context = needle_context(tokenizer, n, depth, sample)
        query = context.queries[0]
        trace = capture(model, tokenizer, context.context_ids + query.question_ids, max_new_tokens=max_new_tokens,
                        progress=False)
        if found_only and query.answer not in trace.generated_text:
            continue
        counted += 1
        steps, emitted = copy_steps(trace, query.span)
        heads = torch.arange(trace.n_heads)
        kv_heads = heads // (trace.n_heads // trace.n_kv_heads)
        tables += [pd.DataFrame(dict(layer=layer, head=heads.numpy(), kv_head=kv_heads.numpy(), copy_steps=steps.numel(),
                                     retrieval_hits=retrieval_hits(trace, layer, steps, emitted, query.span).numpy()))
                   for layer in trace.layers]
    if not counted:
        raise ValueError(f"the model found no needle in {len(specs)} prompts: no copy step to score (found_only=False "
                         "counts every prompt)")
    pooled = pd.concat(tables).groupby(["layer", "head", "kv_head"], as_index=False)[["copy_steps", "retrieval_hits"]].sum()
    pooled.insert(3, "prompts", counted)
    pooled["retrieval_score"] = (pooled.retrieval_hits / pooled.copy_steps).where(pooled.copy_steps > 0)
    pooled = pooled[COLUMNS]
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        pooled.to_csv(path, index=False)
    return pooled


# model -> (layers, query heads) retrieval scores: measured once per model object (the table itself is cached on disk)
_GRIDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def retrieval_score_grid(model, tokenizer) -> torch.Tensor:
    """(layers, query heads) float64 retrieval scores of `model` (`retrieval_heads` with its defaults), kept per model
    object: what the policies that budget by heads (HeadKV, DuoAttention) read. NaN where no copy step was seen."""
    if model not in _GRIDS:
        grid = layer_head_grid(retrieval_heads(model, tokenizer), "retrieval_score")
        _GRIDS[model] = torch.tensor(grid.to_numpy(), dtype=torch.float64)
    return _GRIDS[model]


TABLE = "retrieval_heads.csv"


def recompute(options: dict) -> None:
    """Measure the retrieval heads of options["model"] (None: the default bundled model) afresh, into
    <data_dir>/retrieval_heads.csv (the figure set "heads")."""
    from .models import load_model

    model, tokenizer = load_model(options.get("model"), device="cpu")
    table = retrieval_heads(model, tokenizer, cache=False)
    table.to_csv(Path(options["data_dir"]) / TABLE, index=False)


def draw(data_dir, figures_dir) -> list[Path]:
    """The retrieval-head grid, and finding (b) by head type where data_dir has its findings_b.csv too."""
    from .head_types import findings_by_head_type
    from .heads_figures import draw_head_types, draw_retrieval_heads
    from .legacy import read_table

    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    if not (data_dir / TABLE).exists():
        return []
    table = pd.read_csv(data_dir / TABLE)
    written = draw_retrieval_heads(table, figures_dir)
    if (data_dir / "findings_b.csv").exists():
        written.append(draw_head_types(findings_by_head_type(read_table(data_dir / "findings_b.csv"), table), figures_dir))
    return written


register(FigureSet(name="heads", recompute=recompute, draw=draw))
