"""FINCH (Corallo & Papotti 2024, TACL 12:1517-1532, doi 10.1162/tacl_a_00716, "FINCH: Prompt-guided Key-Value Cache
Compression"): the prompt (the question) that follows the context votes for the context positions to keep.

The authors' code is kvpress's FinchPress: their repository (giulio98/context-compression, README) names it the
official implementation, "bit-exact" with their reference. kvpress 0.5.5, presses/finch_press.py: the input is
context + delimiter + question; the delimiter is cut out of the embeddings and fixes the window, the question's tokens
(FinchPress.embed_token_forward_hook, lines 139-153); the window's attention over the context is SnapKV's, each row
multiplied by its query's index (`normalize_scores`, :73-76), averaged over the window and each GQA group (:79-81);
the window is kept (:84); no pooling.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.attention import attention_probs
from .base import AttentionCall
from .snapkv import SnapKV


@dataclass
class Finch(SnapKV):
    """The question's attention over the context, each of its rows weighted by its query's index, averaged over the
    question's queries; the question kept. A prompt is context + question, the question the last `window_size` tokens.

    window_size: the question's length in tokens. FINCH's window is every token after its delimiter, so one prompt's
        window is its question's token count: set it so. The default 32 (SnapKV's LongBench window) serves where the
        question's length is not known.
    normalize_scores: True (the official) multiplies query i's attention row by i, the count kvpress's code gives
        ("the number of non-zero weights", finch_press.py:73-76), so a later query, whose softmax spreads over more
        keys, weighs as much as an early one; False is SnapKV without pooling over the question.
    score: (heads, n_keys) = mean over window queries i of i * a_ij.

    kvpress re-rotates the kept keys to consecutive positions by default (`rerotate_keys`, finch_press.py:113-116),
    which changes generation after compression, not what is kept: that is `KeyRerotation(policy=Finch(...))`. Not
    done: its `chunk_length` variant (a top-k per chunk of the prompt).
    """

    pooling: str | None = None
    kernel_size: int = 1
    normalize_scores: bool = True

    def score(self, call: AttentionCall):
        query, slots = self.window_queries(call)
        probs = attention_probs(query, call.key, call.attention.scaling, slots,
                                **call.attention.options())  # (heads, window, n_keys)
        if self.normalize_scores:
            probs = probs * slots.to(probs)[:, None]
        return probs.mean(dim=1)
