"""AttentionTrace: the post-RoPE queries and keys of one run, from which any block of any attention map
is recomputed exactly on demand. Memory is linear in tokens: per layer (heads + kv_heads) x head_dim
numbers per token, never a (tokens x tokens) map.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

from .attention import attention_column_sums, attention_probs, attention_row_topk

_FORMAT = "snapkv_lab.AttentionTrace/1"


def positions(selection, n: int) -> torch.Tensor:
    """Positions 0..n-1 picked by None (all), an int, a slice, a list or a tensor (negatives count from n)."""
    everything = torch.arange(n)
    if selection is None:
        return everything
    if isinstance(selection, (int, slice)):
        return everything[selection].reshape(-1)
    return everything[torch.as_tensor(selection, dtype=torch.long)].reshape(-1)


@dataclass
class AttentionTrace:
    """Queries and keys of every token of a run (prompt, then generated or teacher-forced tokens).

    token_ids: (n_tokens,)            tokens: n_tokens decoded strings
    queries[i]: (heads, n_tokens, head_dim) of model layer layers[i], after RoPE
    keys[i]:    (kv_heads, n_tokens, head_dim), after RoPE, before the GQA repeat
    Token t's query row sees keys 0..t. Rows prompt_len.. are the generated tokens.
    """

    token_ids: torch.Tensor
    tokens: list[str]
    prompt_len: int
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    scaling: float
    layers: list[int]
    meta: dict = field(default_factory=dict)

    # ---- shape facts -------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def n_generated(self) -> int:
        return self.n_tokens - self.prompt_len

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_heads(self) -> int:
        return self.queries[0].shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.keys[0].shape[0]

    @property
    def head_dim(self) -> int:
        return self.queries[0].shape[-1]

    @property
    def prompt(self) -> slice:
        return slice(0, self.prompt_len)

    @property
    def generated(self) -> slice:
        return slice(self.prompt_len, self.n_tokens)

    @property
    def generated_text(self) -> str:
        return "".join(self.tokens[self.prompt_len :])

    def __repr__(self) -> str:
        return (
            f"AttentionTrace({self.meta.get('model', '?')}: {self.prompt_len} prompt + {self.n_generated} "
            f"{self.meta.get('mode', 'generated')} tokens, {self.n_layers} layers, {self.n_heads} heads / "
            f"{self.n_kv_heads} KV heads, head_dim {self.head_dim})"
        )

    # ---- attention on demand -----------------------------------------------------------------
    def _operands(self, layer: int, heads, queries):
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not recorded; recorded layers: {self.layers}")
        entry = self.layers.index(layer)
        rows = positions(queries, self.n_tokens)
        # Views where possible: a slice of rows and all heads copy nothing.
        query = self.queries[entry]
        query = query[:, queries] if isinstance(queries, slice) else query.index_select(1, rows)
        kv_index = None
        if heads is not None:
            head_index = positions(heads, self.n_heads)
            kv_index = head_index // (self.n_heads // self.n_kv_heads)
            query = query.index_select(0, head_index)
        return dict(query=query, key=self.keys[entry], scaling=self.scaling, query_positions=rows, kv_index=kv_index)

    def attention(self, layer: int, heads=None, queries=None, keys=None) -> torch.Tensor:
        """Softmax attention probabilities (heads, queries, keys), float32, any block of the causal map.

        heads / queries / keys: None (all), int, slice, list or tensor of indices. Rows are normalised
        over all the keys they see, not only the selected columns.
        """
        return attention_probs(**self._operands(layer, heads, queries), key_index=positions(keys, self.n_tokens))

    def column_sums(self, layer: int, queries=None, heads=None) -> torch.Tensor:
        """(heads, n_tokens): sum over the given query rows of their attention to every key.

        With queries = the observation window this is SnapKV's vote before pooling.
        """
        return attention_column_sums(**self._operands(layer, heads, queries))

    def row_topk(self, layer: int, k: int, queries=None, heads=None):
        """(values, key positions), each (heads, queries, k): the k keys each query row attends to most."""
        return attention_row_topk(**self._operands(layer, heads, queries), k=k)

    # ---- persistence -------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write the trace to one safetensors file (tensors + JSON metadata); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"token_ids": self.token_ids.contiguous().cpu()}
        for layer, q, k in zip(self.layers, self.queries, self.keys):
            tensors[f"layers.{layer}.queries"] = q.contiguous().cpu()
            tensors[f"layers.{layer}.keys"] = k.contiguous().cpu()
        header = dict(format=_FORMAT, tokens=self.tokens, prompt_len=self.prompt_len, scaling=self.scaling,
                      layers=self.layers, meta=self.meta)
        save_file(tensors, str(path), metadata={"snapkv_lab": json.dumps(header)})
        return path

    @classmethod
    def load(cls, path, device: str = "cpu") -> "AttentionTrace":
        """Read a trace written by `save`, onto `device`."""
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("snapkv_lab", "{}"))
        if header.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a snapkv_lab trace (format {header.get('format')!r}, expected {_FORMAT!r})")
        tensors = load_file(str(path), device=device)
        layers = header["layers"]
        return cls(
            token_ids=tensors["token_ids"],
            tokens=header["tokens"],
            prompt_len=header["prompt_len"],
            queries=[tensors[f"layers.{layer}.queries"] for layer in layers],
            keys=[tensors[f"layers.{layer}.keys"] for layer in layers],
            scaling=header["scaling"],
            layers=layers,
            meta=header["meta"],
        )
