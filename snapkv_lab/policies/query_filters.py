"""The main direction of each KV head's queries, measured on the model itself: Q-Filters' calibration (Godey et
al. 2025, arXiv 2503.02812, "Q-Filters: Leveraging Query-Key Geometry for Efficient Key-Value Cache Compression").

    filters = query_filters(model, tokenizer)   # (layers, kv_heads, head_dim), unit vectors

The paper finds that a head's queries are anisotropic: they lean along one direction u, E[<q, u>] > 0, so the
expected attention logit of a key is about E[<q, u>] <k, u>, and a key's projection on u ranks it without any
attention weight. u is the first right singular vector of the matrix of the head's queries over calibration text
(an SVD of the queries themselves, not centred), with its sign chosen so that the queries' mean projection is
positive. Here:
    - the queries are the post-RoPE ones the attention call receives (the keys they are compared with in the cache
      are post-RoPE too), over `tokens` tokens of the standard library's documentation (pydoc topics: always on
      the machine, and outside the lab's needle haystacks), read in sequences of `sequence` tokens;
    - a KV head's direction pools the queries of every query head that reads it (GQA), one filter per KV head, as
      the published filters' shape (layers, kv_heads, head_dim);
    - the right singular vector is the top eigenvector of Q^T Q, accumulated sequence by sequence in float64.
kvpress's QFilterPress loads the authors' published filters from the Hub and scores -<f, k>: their filters point
the other way, and the kept set is the same. Results are cached per model and settings in the cache folder; the
bundled SmolLM2's ship in the package (policies/weights/query_filters/, written by scripts/ship_calibrations.py), as
the authors publish theirs, so that a new machine does not measure them again (28 s on one core).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.hooks import intercept_attention
from ..core.models import measured_cache_path, write_whole
from ..tasks.corpus import haystack_ids
from .trained_weights import find_file

TOKENS, SEQUENCE = 8192, 1024


@torch.no_grad()  # not inference_mode: the filters meet keys of forwards autograd may track
def query_filters(model, tokenizer, *, tokens: int = TOKENS, sequence: int = SEQUENCE,
                  cache: bool = True) -> torch.Tensor:
    """(layers, kv_heads, head_dim) float32 unit vectors on the model's device: per layer and KV head, the main
    direction of its query heads' post-RoPE queries over `tokens` calibration tokens (module doc). cache: read the
    filters shipped in the package (policies/weights/query_filters/: the bundled models' at the defaults) or
    <cache folder>/query_filters/<model>-<hash>.pt, else measure and write the latter."""
    sequence = _sequence(model, tokens, sequence)
    found = find_filters(model, tokens, sequence) if cache else None
    if found is not None:
        return torch.load(found).to(model.device)
    gram, total = {}, {}  # per layer: (kv_heads, d, d) sum of q q^T, (kv_heads, d) sum of q

    def collect(module, query, key, value, attention_mask, **kwargs):
        kv_heads = key.shape[1]
        q = query.double().unflatten(1, (kv_heads, -1)).flatten(2, 3)  # (batch, kv_heads, group * rows, d)
        layer = module.layer_idx
        gram[layer] = gram.get(layer, 0) + torch.einsum("bhrd,bhre->hde", q, q)
        total[layer] = total.get(layer, 0) + q.sum(dim=(0, 2))

    ids = torch.tensor(haystack_ids(tokenizer, tokens - tokens % sequence, source="pydoc"), device=model.device)
    with intercept_attention(model, collect):
        for chunk in ids.view(-1, sequence):
            model(chunk[None], use_cache=False, logits_to_keep=1)
    filters = torch.stack([_main_direction(gram[layer], total[layer]) for layer in sorted(gram)]).float()
    if cache:
        write_whole(filters_path(model, tokens, sequence), lambda tmp: torch.save(filters.cpu(), tmp))
    return filters.to(model.device)


def filters_path(model, tokens: int = TOKENS, sequence: int = SEQUENCE) -> Path:
    """Where `query_filters(model, ..., tokens=tokens, sequence=sequence)` is cached (it may not exist yet)."""
    settings = dict(tokens=tokens, sequence=_sequence(model, tokens, sequence))
    return measured_cache_path("query_filters", model, settings, "pt")


def find_filters(model, tokens: int = TOKENS, sequence: int = SEQUENCE) -> Path | None:
    """The file `query_filters(model, ...)` reads: shipped in the package (module doc), else measured into the cache
    folder before; None before either."""
    return find_file("query_filters", filters_path(model, tokens, sequence).name)


def _sequence(model, tokens: int, sequence: int) -> int:
    """The calibration's sequence length: no longer than the tokens, nor than the model's positions."""
    return min(sequence, tokens, getattr(model.config, "max_position_embeddings", None) or sequence)


def _main_direction(gram: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """(kv_heads, d, d) Q^T Q and (kv_heads, d) the sum of the queries -> (kv_heads, d): the top eigenvector of
    Q^T Q (Q's first right singular vector), signed so that the queries' mean projection on it is positive."""
    direction = torch.linalg.eigh(gram).eigenvectors[..., -1]  # eigenvalues ascending
    sign = torch.sign((direction * total).sum(dim=-1, keepdim=True))
    return direction * torch.where(sign == 0, 1.0, sign)
