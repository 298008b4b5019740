"""LU-KV (arXiv 2602.08585, "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache
Eviction"): head-wise budgets read off a budget curve computed offline, over any scorer. kvpress 0.5.5's LUKVPress
(kvpress/presses/lukv_press.py) is the reference: its defaults, LUKVPress(ExpectedAttentionPress(epsilon=2e-2),
sink=4, window=1), are ours.

The curve is an array (99, layers, KV heads) of prune ratios: row i holds, for a global compression ratio of
(i + 1) / 100, the share of its positions each layer's KV head evicts. At ratio r (our capacity share 1 - r, or a
token budget B of an n-token prompt, r = 1 - B / n) each layer reads row clamp(round(100 r) - 1, 0, 98)
(lukv_press.py:141-142) and each KV head keeps (1 - its prune ratio) n positions: the layer's total rounded, the
heads' floors, the remainder to the heads of largest fraction (one top-k), none below 1 (:155-169). Within a head
the wrapped scorer ranks the positions; its first `sink` and last `window` positions are protected, taken before
any other and, where a head keeps fewer than them, in position order (kvpress gives them max + 1 and sorts stably,
:133-139 and :175). Heads keep different counts: the layer is stored ragged (compression.layers.HeadwiseLayer), as
kvpress masks the evicted keys.

Curves are per model and per scorer. kvpress downloads the one published, Llama-3.1-8B-Instruct's for
ExpectedAttentionPress(epsilon=2e-2) with sink 4 and window 1, from the authors' repository (:19-29); LU-KV's code
that makes a curve (its evaluation/curve_data/generate_curve.sh: scorer statistics over a dataset, then the averaged
curve) is neither in kvpress nor reachable from this machine, so no curve is made or shipped here for the bundled
models: `curve=` takes the path of a .npy file, and a model without one is refused, saying so.

What differs from kvpress: the capacity's ratio indexes the curve where kvpress takes its compression_ratio (the
same number for a share; a token budget is turned into its share of the prompt); the rest is its arithmetic, in
float32 as kvpress's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..core.checks import check_int
from .base import LayerBudget, Policy
from .expected_attention import ExpectedAttention
from .trained_weights import find_file, model_label
from .wrapper import Wrapper, refuse_own_allocation

CURVE_ROWS = 99  # ratios 0.01 ... 0.99


def find_curve(model) -> Path | None:
    """A curve shipped for `model` (policies/weights/lukv/<its name>.npy) or put into the cache folder's lukv/."""
    return find_file("lukv", f"{model_label(model)}.npy")


def keep_counts(prune: torch.Tensor, n_tokens: int) -> list[int]:
    """Positions each KV head keeps of `n_tokens` for prune ratios `prune` (kv_heads,) float32 (lukv_press.py:155-169):
    the layer's rounded total, each head's floor, the remainder to the largest fractions, clamped to [1, n]."""
    kv_heads = prune.shape[0]
    ideal = (1.0 - prune.float()).clamp(min=0.0, max=1.0) * n_tokens
    total = max(kv_heads, min(kv_heads * n_tokens, int(torch.round(ideal.sum()).item())))
    counts = torch.floor(ideal).long()
    remainder = total - int(counts.sum().item())
    if remainder > 0:
        counts[torch.topk(ideal - counts, k=min(remainder, kv_heads)).indices] += 1
    return counts.clamp(min=1, max=n_tokens).tolist()


@dataclass
class LUKV(Wrapper):
    """Head-wise budgets from an LU-KV budget curve (module doc) over `policy`'s ranking (kvpress's default:
    ExpectedAttention(epsilon=0.02)); the first `sink` and the last `window` positions protected. curve: the path of a
    (99, layers, KV heads) .npy of prune ratios; None: the one found for the model (none is shipped)."""

    policy: Policy = field(default_factory=lambda: ExpectedAttention(epsilon=2e-2))
    sink: int = 4
    window: int = 1
    curve: str | None = None

    def __post_init__(self):
        if self.kept_tail is not None:
            raise ValueError("LUKV protects its last `window` positions by rank, as kvpress: set window, not kept_tail")
        super().__post_init__()
        check_int("sink", self.sink, 0)
        check_int("window", self.window, 0)
        if self.per_query_head:
            raise ValueError("LUKV's curve budgets KV heads: per_query_head=True is not supported")
        refuse_own_allocation(self, "reads each head's budget off its curve", "LUKV(policy=ExpectedAttention())")
        if self.curve is not None and not Path(self.curve).is_file():
            raise ValueError(f"LUKV curve {self.curve!r}: no such file")
        self._curve: np.ndarray | None = None

    def shared(self) -> dict:
        """The inner policy ranks every position (no kept tail of its own): the window is LU-KV's, protected by rank."""
        return dict(super().shared(), kept_tail=0)

    def tail(self, budget: int) -> int:
        return 0

    def prepare(self, model, tokenizer) -> None:
        super().prepare(model, tokenizer)
        path = Path(self.curve) if self.curve is not None else find_curve(model)
        if path is None:
            raise ValueError(
                f"{self.label} has no budget curve for the model {model_label(model)!r}: LU-KV's curves are made per "
                "model and scorer by its authors' code (baidu-baige/LU-KV, evaluation/curve_data/generate_curve.sh), "
                "which is neither in kvpress nor reachable here, and the one published is Llama-3.1-8B-Instruct's for "
                "ExpectedAttention(epsilon=0.02). Pass curve=PATH, a (99, layers, KV heads) .npy of prune ratios")
        curve = np.load(path, allow_pickle=False)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        shape = (CURVE_ROWS, config.num_hidden_layers,
                 getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        if curve.shape != shape:
            raise ValueError(f"LUKV curve {path}: shape {curve.shape}, where this model needs {shape} (ratios, layers, "
                             "KV heads)")
        self._curve = curve

    def _row(self, budget: LayerBudget) -> int:
        """The curve's row for this budget: its compression ratio's percent, less one, within [0, 98]."""
        share = self.capacity if isinstance(self.capacity, float) else budget.capacity / budget.tokens
        return max(0, min(CURVE_ROWS - 1, int(round((1 - share) * 100)) - 1))

    def head_budgets(self, scores, budget: LayerBudget) -> list[int]:
        if self._curve is None:
            raise ValueError(f"{self.label}: its curve is read by prepare(model, tokenizer), which every entry point "
                             "calls before the first prefill")
        prune = torch.as_tensor(self._curve[self._row(budget), budget.layer], dtype=torch.float32)
        if prune.shape[0] != budget.kv_heads:
            raise ValueError(f"LUKV curve has {prune.shape[0]} KV heads in layer {budget.layer}, the cache "
                             f"{budget.kv_heads}")
        return keep_counts(prune, budget.tokens)

    def ranked(self, scores, budget: LayerBudget) -> torch.Tensor:
        """The inner ranking over every position, the protected ones above all others in position order: the first
        `sink`, the last `window`, and, where a score is +inf anywhere (kvpress's max + 1 is then +inf too), each
        head's +inf positions (tied with them in kvpress, its stable sort taking them by position)."""
        ranked = self.policy.ranked(scores, budget)
        n = ranked.shape[-1]
        protected = torch.zeros_like(ranked, dtype=torch.bool)
        protected[:, :min(self.sink, n)] = True
        protected[:, max(0, n - self.window):] = True
        protected |= torch.isposinf(ranked)
        order = protected.long().cumsum(-1)  # 1, 2, ... over a head's protected positions, by position
        top = torch.finfo(torch.float32).max
        return torch.where(protected, top * (1 - order.float() * 1e-3), ranked)
