"""Key re-rotation: the kept keys re-rotated by RoPE to contiguous positions, over any scorer.

NVIDIA kvpress 0.5.5's KeyRerotationPress (kvpress/presses/key_rerotation_press.py), the rule of transformers'
SinkCache and of FINCH (Corallo & Papotti 2024, whose official code is kvpress's FinchPress, `rerotate_keys=True` by
default, finch_press.py:112-114); kvpress is its code, and our defaults are its. The inner press chooses the kept
positions as it would to evict (`scores.topk(n_kept)`, sorted, :146-149); then kept key i, rotated by RoPE at its
position p_i, is rotated by the difference to its new position (:81-86: delta = i - p_i; :128: k * cos + rotate_half(k)
* sin), so the kept keys sit at consecutive positions, as if the evicted tokens had never been there.

Where the positions go. kvpress puts kept key i at position i and then starts the question and the answer at the
cache's length, k (pipeline.py:237-238: `context_length = cache.get_seq_length()` for this press; :289-312 the
position ids from there). The lab's every entry point (generate, model.generate under `compress`, forks, multi-turn
feeds) goes on at the prompt's own length n instead. So ours puts kept key i at n - k + i: the kept block ends right
before the next token, at the same distance from every later query as kvpress's, and RoPE's attention depends on that
distance alone (q_m . k_j = q . R(j - m) k), so every later attention score is kvpress's, up to float rounding
(tests/test_key_rerotation.py decodes both ways). Positions are counted in the layer's slots, which RoPE rotated at
contiguous positions ending at the last token seen (a fresh prompt's slots are its positions; after a re-rotation the
kept block and the tokens after it are contiguous again), so a chunked prefill or a feed over a re-rotated cache
re-rotates the same way. A head that keeps a different count (AdaKV) ends its own block at n - 1; sliding-window layers,
never compressed, keep their positions, which stay consistent with the next token's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..core.rope import LayerRope
from .base import NO_POSITION, Policy
from .decoding import EvictsWhileDecoding
from .snapkv import SnapKV
from .wrapper import Wrapper, policy_chain


@dataclass
class KeyRerotation(Wrapper):
    """`policy` (SnapKV by default) chooses what is kept; the kept keys are re-rotated to contiguous positions ending
    at the last prompt token (see module doc). What is kept is the inner policy's own."""

    keeps_inner_selection: ClassVar[bool] = True
    policy: Policy = field(default_factory=SnapKV)

    def __post_init__(self):
        super().__post_init__()
        if self.per_query_head:
            raise ValueError("KeyRerotation re-rotates the keys of KV heads: per_query_head=True is not supported")
        inner = next((p for p in policy_chain(self.policy) if isinstance(p, EvictsWhileDecoding)), None)
        if inner is not None and inner.interval is not None:
            raise ValueError(f"{inner.name} evicts while decoding (interval={inner.interval}), after which the kept "
                             f"keys are no longer contiguous: wrap {inner.name}(interval=None)")

    def rekey(self, key: torch.Tensor, kept: torch.Tensor, module) -> torch.Tensor:
        """key (kv_heads, n, head_dim) post-RoPE, kept (kv_heads, k) slots (NO_POSITION padding) -> (kv_heads, n,
        head_dim): each head's j-th kept key (in slot order) rotated from its slot to slot n - k_h + j (float32, stored
        in key's dtype); the others as they were."""
        if module is None:
            raise RuntimeError(f"{self.label} re-rotates keys by the layer's RoPE: the engine must pass the layer's "
                               "attention module")
        rope = LayerRope.of(module, key.shape[-1])
        rotated = key.clone()
        n = key.shape[1]
        for head, row in enumerate(kept):
            held = row[row != NO_POSITION].sort().values
            new = torch.arange(n - len(held), n, device=held.device)
            rotated[head, held] = rope.rerotate(key[head:head + 1, held], held, new)[0]
        return rotated
