"""AttentionTrace: the post-RoPE queries and keys of one run, from which any block of any attention map
is recomputed exactly on demand. Memory is linear in tokens: per layer (heads + kv_heads) x head_dim
numbers per token, never a (tokens x tokens) map.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

from .attention import AttentionSettings, attention_column_sums, attention_probs, attention_row_topk

# Version 2 adds each layer's attention settings (sliding window, soft-cap); version 1 files had one scaling
# for all layers and full causal attention, which is what they are read as.
_FORMAT = "snapkv_lab.AttentionTrace/2"
_READABLE_FORMATS = ("snapkv_lab.AttentionTrace/1", _FORMAT)
VALUE_KINDS = ("values", "value_norms", "output_norms")  # optional per-layer tensors (capture(..., values=True))


def positions(selection, n: int) -> torch.Tensor:
    """Positions 0..n-1 picked by None (all), an int, a slice, indices (negatives count from n) or a boolean
    mask of length n. Returns a (k,) long tensor on the CPU."""
    everything = torch.arange(n)
    if selection is None:
        return everything
    if isinstance(selection, (int, slice)):
        return everything[selection].reshape(-1)
    selection = torch.as_tensor(selection).cpu()
    if selection.dtype == torch.bool:
        if selection.shape != (n,):
            raise ValueError(f"a boolean mask of positions must have shape ({n},), got {tuple(selection.shape)}")
        return everything[selection]
    if selection.is_floating_point():
        raise TypeError(f"positions must be integers or a boolean mask, got {selection.dtype}")
    return everything[selection.long()].reshape(-1)


class LazyLayers(Sequence):
    """One tensor per recorded layer of a saved trace, read from the file when indexed: a 32k-token trace of a
    large model is many GB, and a view needs one layer. The last `keep` layers read stay in memory."""

    def __init__(self, path, names: list[str], device: str = "cpu", keep: int = 2):
        self.path, self.names, self.device, self.keep = str(path), names, device, keep
        with safe_open(self.path, framework="pt") as f:
            self.shapes = [torch.Size(f.get_slice(name).get_shape()) for name in names]
        self._loaded: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> torch.Tensor:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        index = range(len(self))[index]
        if index not in self._loaded:
            with safe_open(self.path, framework="pt", device=self.device) as f:
                self._loaded[index] = f.get_tensor(self.names[index])
            while len(self._loaded) > self.keep:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(index)
        return self._loaded[index]


def _shapes(tensors) -> list[torch.Size]:
    """Shapes of per-layer tensors without reading a lazy trace's layers."""
    return list(tensors.shapes) if isinstance(tensors, LazyLayers) else [t.shape for t in tensors]


@dataclass
class AttentionTrace:
    """Queries and keys of every token of a run (prompt, then generated or teacher-forced tokens).

    token_ids: (n_tokens,)            tokens: n_tokens decoded strings
    queries[i]: (heads, n_tokens, head_dim) of model layer layers[i], after RoPE (a list, or LazyLayers that
        read each layer from a saved file when used: `AttentionTrace.load(path, lazy=True)`)
    keys[i]:    (kv_heads, n_tokens, head_dim), after RoPE, before the GQA repeat
    attention_settings[i]: that layer's scaling, sliding window and soft-cap, applied by every recompute
    values[i]:  (kv_heads, n_tokens, head_dim), or None: recorded by capture(..., values=True) only
    value_norms[i]: (heads, n_tokens) float32, or None: ||W_O^h v_t||, the length of what token t's value adds to
        the residual stream through query head h's slice of the output projection (CriticalKV's and VATP's weight)
    output_norms[i]: (heads,) float32, or None: the Frobenius norm of each head's slice W_O^h
    Token t's query row sees keys 0..t (the last `sliding_window` of them in a sliding layer). Rows
    prompt_len.. are the generated tokens.
    """

    token_ids: torch.Tensor
    tokens: list[str]
    prompt_len: int
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    attention_settings: list[AttentionSettings]
    layers: list[int]
    meta: dict = field(default_factory=dict)
    values: list[torch.Tensor] | None = None
    value_norms: list[torch.Tensor] | None = None
    output_norms: list[torch.Tensor] | None = None

    def __post_init__(self):
        _check_consistent(self)

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
        return _shapes(self.queries)[0][0]

    @property
    def n_kv_heads(self) -> int:
        return _shapes(self.keys)[0][0]

    @property
    def head_dim(self) -> int:
        return _shapes(self.queries)[0][-1]

    @property
    def scaling(self) -> float:
        """The attention scale shared by every recorded layer."""
        scalings = {a.scaling for a in self.attention_settings}
        if len(scalings) != 1:
            raise ValueError(f"layers use different scalings {sorted(scalings)}; read trace.attention_settings")
        return scalings.pop()

    def layer_settings(self, layer: int) -> AttentionSettings:
        """The attention settings of model layer `layer`."""
        return self.attention_settings[self._entry(layer)]

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
    def _entry(self, layer: int) -> int:
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not recorded; recorded layers: {self.layers}")
        return self.layers.index(layer)

    def _operands(self, layer: int, heads, queries):
        entry = self._entry(layer)
        rows = positions(queries, self.n_tokens)  # stays on the CPU: block bounds are read from it
        # Views where possible: a slice of rows and all heads copy nothing.
        query = self.queries[entry]
        query = query[:, queries] if isinstance(queries, slice) else query.index_select(1, rows.to(query.device))
        kv_index = None
        if heads is not None:
            head_index = positions(heads, self.n_heads).to(query.device)
            kv_index = head_index // (self.n_heads // self.n_kv_heads)
            query = query.index_select(0, head_index)
        settings = self.attention_settings[entry]
        return dict(query=query, key=self.keys[entry], scaling=settings.scaling, query_positions=rows,
                    kv_index=kv_index, **settings.options())

    def attention(self, layer: int, heads=None, queries=None, keys=None) -> torch.Tensor:
        """Softmax attention probabilities (heads, queries, keys), float32, any block of the causal map.

        heads / queries / keys: None (all), int, slice, list or tensor of indices. Rows are normalised
        over all the keys they see, not only the selected columns.
        """
        return attention_probs(**self._operands(layer, heads, queries), key_index=positions(keys, self.n_tokens))

    def value_attention(self, layer: int, heads=None, queries=None, keys=None) -> torch.Tensor:
        """(heads, queries, keys) float32: attention x ||W_O^h v_key||, the value-aware importance CriticalKV and VATP
        rank by (each query row's attention weighted by what each key's value contributes through the head's output
        projection); needs a trace captured with values=True."""
        if self.value_norms is None:
            raise ValueError("this trace holds no values: capture(..., values=True) records them")
        attention = self.attention(layer, heads, queries, keys)
        norms = self.value_norms[self._entry(layer)]
        if heads is not None:
            norms = norms.index_select(0, positions(heads, self.n_heads).to(norms.device))
        return attention * norms[:, None, positions(keys, self.n_tokens).to(norms.device)].to(attention.device)

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
        for i, (layer, q, k) in enumerate(zip(self.layers, self.queries, self.keys, strict=True)):
            tensors[f"layers.{layer}.queries"] = q.contiguous().cpu()
            tensors[f"layers.{layer}.keys"] = k.contiguous().cpu()
            for kind in VALUE_KINDS:
                if getattr(self, kind) is not None:
                    tensors[f"layers.{layer}.{kind}"] = getattr(self, kind)[i].contiguous().cpu()
        header = dict(format=_FORMAT, tokens=self.tokens, prompt_len=self.prompt_len, layers=self.layers,
                      attention_settings=[asdict(a) for a in self.attention_settings], meta=self.meta)
        save_file(tensors, str(path), metadata={"snapkv_lab": json.dumps(header)})
        return path

    @classmethod
    def load(cls, path, device: str = "cpu", *, lazy: bool = False) -> "AttentionTrace":
        """Read a trace written by `save`, onto `device`. lazy=True reads only the token ids and metadata now,
        and each layer's queries and keys when a computation first needs them (LazyLayers). A file that is not
        a whole, consistent trace raises ValueError saying what is wrong."""
        try:
            with safe_open(str(path), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("snapkv_lab", "{}"))
                names = set(f.keys())
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 - a corrupt file raises safetensors' own SafetensorError, or bad JSON
            raise ValueError(f"{path} is not a readable snapkv_lab trace: {err}") from err
        if header.get("format") not in _READABLE_FORMATS:
            raise ValueError(f"{path} is not a snapkv_lab trace (format {header.get('format')!r}, "
                             f"expected {_FORMAT!r})")
        fields = ("tokens", "prompt_len", "layers", "meta")
        missing = [f for f in fields if f not in header] + [f"layers.{layer}.{kind}"
                                                              for layer in header.get("layers", [])
                                                              for kind in ("queries", "keys")
                                                              if f"layers.{layer}.{kind}" not in names]
        missing += [] if "token_ids" in names else ["token_ids"]
        if missing:
            raise ValueError(f"{path} is an incomplete snapkv_lab trace: missing {', '.join(missing)}")
        layers = header["layers"]
        if "attention_settings" in header:
            attention = [AttentionSettings(**a) for a in header["attention_settings"]]
        else:  # format 1: one scaling, full causal attention
            attention = [AttentionSettings(scaling=header["scaling"]) for _ in layers]
        kinds = ["queries", "keys"] + [kind for kind in VALUE_KINDS if f"layers.{layers[0]}.{kind}" in names]
        names = {kind: [f"layers.{layer}.{kind}" for layer in layers] for kind in kinds}
        if lazy:
            with safe_open(str(path), framework="pt", device=device) as f:
                token_ids = f.get_tensor("token_ids")
            stored = {kind: LazyLayers(path, names[kind], device) for kind in kinds}
        else:
            tensors = load_file(str(path), device=device)
            token_ids = tensors["token_ids"]
            stored = {kind: [tensors[name] for name in names[kind]] for kind in kinds}
        try:
            return cls(
                token_ids=token_ids,
                tokens=header["tokens"],
                prompt_len=header["prompt_len"],
                attention_settings=attention,
                layers=layers,
                meta=header["meta"],
                **stored,
            )
        except ValueError as err:
            raise ValueError(f"{path} is not a consistent snapkv_lab trace: {err}") from err


def _check_consistent(trace: AttentionTrace) -> None:
    """Shapes and counts that every method relies on; a trace that breaks one would give wrong maps."""
    n = trace.token_ids.numel()
    problems = []
    if trace.token_ids.ndim != 1:
        problems.append(f"token_ids must be 1-D, got shape {tuple(trace.token_ids.shape)}")
    if len(trace.tokens) != n:
        problems.append(f"{len(trace.tokens)} decoded tokens for {n} token ids")
    if not 0 < trace.prompt_len <= n:
        problems.append(f"prompt_len {trace.prompt_len} outside 1..{n} (the number of tokens)")
    if not len(trace.layers) == len(trace.queries) == len(trace.keys) == len(trace.attention_settings) > 0:
        problems.append(f"{len(trace.layers)} layers, {len(trace.queries)} query tensors, "
                        f"{len(trace.keys)} key tensors "
                        f"and {len(trace.attention_settings)} attention settings: they must be equal and non-zero")
    for layer, q, k in zip(trace.layers, _shapes(trace.queries), _shapes(trace.keys)):
        if len(q) != 3 or len(k) != 3 or q[1] != n or k[1] != n or q[-1] != k[-1]:
            problems.append(f"layer {layer}: queries {tuple(q)} and keys {tuple(k)} do not fit "
                            f"(heads, {n}, head_dim) and (kv_heads, {n}, head_dim)")
        elif q[0] % k[0]:
            problems.append(f"layer {layer}: {q[0]} query heads cannot share {k[0]} KV heads")
    expected = dict(values=lambda q, k: (k[0], n, None), value_norms=lambda q, k: (q[0], n),
                    output_norms=lambda q, k: (q[0],))
    for kind in VALUE_KINDS:
        stored = getattr(trace, kind)
        if stored is None:
            continue
        if len(_shapes(stored)) != len(trace.layers):
            problems.append(f"{len(_shapes(stored))} {kind} tensors for {len(trace.layers)} layers")
        for layer, q, k, shape in zip(trace.layers, _shapes(trace.queries), _shapes(trace.keys), _shapes(stored)):
            want = expected[kind](q, k)
            if len(shape) != len(want) or any(w is not None and w != s for w, s in zip(want, shape)):
                problems.append(f"layer {layer}: {kind} of shape {tuple(shape)}, expected {want} (None: any)")
    if problems:
        raise ValueError("; ".join(problems))
