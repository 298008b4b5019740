"""Which heads retrieve: Wu et al.'s retrieval score of every (layer, query head), measured on the model itself.

    table = retrieval_heads(model, tokenizer)       # one row per (layer, head), pooled over needle prompts
    heads_grid_figure(table, "retrieval_score")     # the layer x head grid (snapkv_lab.views.heads)

The protocol of the official detection (nightdessert/Retrieval_Head, retrieval_head_detection.py at commit
3ac171a), on the lab's own needles (`tasks.needles.needle_context`: a 7-digit value in Paul Graham's essays, asked for
by its key) instead of the official needle sentences:
    - the model answers each needle prompt greedily (the official decodes up to 50 tokens, lines 235-246);
    - a prompt counts only if the model found the needle (the official keeps answers whose ROUGE-1 recall of the
      needle is above 50, lines 298-300; here the answer must hold the value);
    - in each counted answer, a copy step is an emitted token found in the needle's tokens, and a head hits when
      its top-attended key holds that token inside the needle (`copy_steps` and `retrieval_hits`, as
      `views.heads.head_table` counts them; lines 221-229).
The score pools the prompts as hits over copy steps (the official averages per-test scores normalised by the
needle's length: the two agree when every answer copies the needle once). Results are cached per model and
settings in the cache folder (`models.cache_dir()`), so a policy built from them (DuoAttention, HeadKV) pays the
captures once per model; the bundled SmolLM2's table ships in the package (policies/weights/retrieval_heads/, written
by scripts/ship_calibrations.py), as the official detection ships its models' scores (head_score/*.json), so that a
new machine does not capture its 10 prompts again (65 s on one core).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pandas as pd
import torch

from ..core.capture import capture
from ..core.models import measured_cache_path, write_whole
from ..core.progress import progress_bar
from ..tasks.needles import needle_context
from .trained_weights import find_file

LENGTHS = (1000, 2000)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
COLUMNS = ["layer", "head", "kv_head", "prompts", "copy_steps", "retrieval_hits", "retrieval_score"]


def retrieval_heads(model, tokenizer, *, lengths=LENGTHS, depths=DEPTHS, samples: int = 1, max_new_tokens: int = 16,
                    found_only: bool = True, cache: bool = True, progress: bool = True) -> pd.DataFrame:
    """One row per (layer, query head): prompts (needle prompts counted), copy_steps and retrieval_hits summed
    over them, retrieval_score = hits / copy steps (NaN with no copy step). Needle prompts: every length x depth x
    sample (`tasks.needles.needle_context`). found_only=False counts every prompt, found or not (not the official
    filter). cache: read the table shipped in the package (policies/weights/retrieval_heads/: the bundled models' at
    the defaults) or <cache folder>/retrieval_heads/<model>-<settings hash>.csv, else measure and write the latter."""
    path = table_path(model, lengths=lengths, depths=depths, samples=samples, max_new_tokens=max_new_tokens,
                      found_only=found_only)
    found = find_file("retrieval_heads", path.name)  # shipped (module doc), else measured here before
    if cache and found is not None:
        return pd.read_csv(found)
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
        tables += [pd.DataFrame(dict(layer=layer, head=heads.numpy(), kv_head=kv_heads.numpy(),
                                     copy_steps=steps.numel(),
                                     retrieval_hits=retrieval_hits(trace, layer, steps, emitted, query.span).numpy()))
                   for layer in trace.layers]
    if not counted:
        raise ValueError(f"the model found no needle in {len(specs)} prompts: no copy step to score (found_only=False "
                         "counts every prompt)")
    pooled = (pd.concat(tables).groupby(["layer", "head", "kv_head"], as_index=False)
              [["copy_steps", "retrieval_hits"]].sum())
    pooled.insert(3, "prompts", counted)
    pooled["retrieval_score"] = (pooled.retrieval_hits / pooled.copy_steps).where(pooled.copy_steps > 0)
    pooled = pooled[COLUMNS]
    if cache:
        write_whole(path, lambda tmp: pooled.to_csv(tmp, index=False))
    return pooled


def table_path(model, *, lengths=LENGTHS, depths=DEPTHS, samples: int = 1, max_new_tokens: int = 16,
               found_only: bool = True) -> Path:
    """Where `retrieval_heads(model, ...)` with these settings is cached (it may not exist yet); a shipped table has
    this file's name."""
    settings = dict(model=str(getattr(model.config, "name_or_path", "")), lengths=list(lengths), depths=list(depths),
                    samples=samples, max_new_tokens=max_new_tokens, found_only=found_only)
    return measured_cache_path("retrieval_heads", model, settings, "csv")


# model -> (layers, query heads) retrieval scores: measured once per model object (the table itself is cached on disk)
_GRIDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def retrieval_score_grid(model, tokenizer) -> torch.Tensor:
    """(layers, query heads) float64 retrieval scores of `model` (`retrieval_heads` with its defaults), kept per model
    object: what the policies that budget by heads (HeadKV, DuoAttention) read. NaN where no copy step was seen."""
    if model not in _GRIDS:
        grid = layer_head_grid(retrieval_heads(model, tokenizer), "retrieval_score")
        _GRIDS[model] = torch.tensor(grid.to_numpy(), dtype=torch.float64)
    return _GRIDS[model]


def copy_steps(trace, span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The copy steps of a trace: (rows, emitted), each (steps,) long on the CPU; row rows[i] emitted the token
    id emitted[i] = token_ids[rows[i] + 1], a token id found at some position of span = (start, end)."""
    ids = trace.token_ids.cpu()
    rows = torch.arange(trace.prompt_len - 1, trace.n_tokens - 1)
    emitted = ids[rows + 1]
    copied = torch.isin(emitted, ids[span[0]:span[1]])
    return rows[copied], emitted[copied]


def retrieval_hits(trace, layer: int, rows: torch.Tensor, emitted: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """(heads,) long: at how many copy steps (`copy_steps`) each head's top-attended key lies in the span and
    holds the emitted token id."""
    if rows.numel() == 0:
        return torch.zeros(trace.n_heads, dtype=torch.long)
    top = trace.row_topk(layer, 1, queries=rows)[1][..., 0].cpu()  # (heads, steps) key positions
    inside = (top >= span[0]) & (top < span[1])
    holds = trace.token_ids.cpu()[top.clamp(min=0)] == emitted[None]
    return (inside & holds).sum(dim=1)


def layer_head_grid(table: pd.DataFrame, column: str) -> pd.DataFrame:
    """(layers, heads) frame of one column of a per-(layer, head) table, layers and heads ascending."""
    return table.pivot(index="layer", columns="head", values=column).sort_index().sort_index(axis=1)
