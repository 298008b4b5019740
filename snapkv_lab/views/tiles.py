"""Exact attention at any zoom: one head's map (or the average of a layer's heads) pooled into square blocks
of tokens, with the block max and block mean of the exact probabilities, as a map viewer draws tiles.

A long map is never held whole. The first view of a (layer, head) makes one exact pass over its rows and keeps
a base grid, blocks of `base_block` tokens, and every row's log-sum-exp. Coarser views are pooled from the base
grid; finer ones, down to single tokens, are recomputed for the rows and columns in view only, from the queries,
the keys and the stored log-sum-exp. Memory: the base grid, at most (base_cells x base_cells) per stored head,
plus what is drawn; never (n_tokens x n_tokens).

A view's rows and columns are snapped outwards to multiples of its block, so a block is always
[i * block, (i + 1) * block) in token positions (the last one stops at the trace's end): the same cells at every
zoom, which is what makes pooled levels exact poolings of each other. Keys a row cannot see count as 0.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..core.attention import BLOCK_ELEMENTS, attention_logits
from ..core.progress import progress_bar

HEAD_MEAN = "mean"  # the head value that averages a layer's query heads' probabilities before pooling
_FORMAT = "snapkv_lab.AttentionTiles/1"


@dataclass(frozen=True)
class Tile:
    """One pooled view of one map: cell (i, j) covers query positions rows[i*block : (i+1)*block] and key
    positions cols[j*block : (j+1)*block].

    max, mean: (n_row_cells, n_col_cells) float32; with block 1 both are the exact probabilities.
    """

    layer: int
    head: int | str
    rows: range
    cols: range
    block: int
    max: torch.Tensor
    mean: torch.Tensor


@dataclass
class _Base:
    """The one exact pass over a map: block maxima and sums at base_block, and each head's row log-sum-exp."""

    block: int
    max: torch.Tensor  # (cells, cells)
    sum: torch.Tensor  # (cells, cells)
    lse: torch.Tensor  # (heads in the view, n_tokens)


def next_power_of_two(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def as_span(selection, n: int) -> range:
    """Consecutive positions within 0..n as a range: None (all), a slice, a range or a (start, stop) pair."""
    if selection is None:
        return range(n)
    if isinstance(selection, tuple) and len(selection) == 2:
        selection = slice(*selection)
    if isinstance(selection, range):
        selection = slice(selection.start, selection.stop, selection.step)
    if not isinstance(selection, slice) or selection.step not in (None, 1):
        raise TypeError(f"a view covers consecutive positions: pass a slice, range or (start, stop), got {selection!r}")
    span = range(n)[selection]
    if len(span) == 0:
        raise ValueError(f"{selection} holds no position of a {n}-token trace")
    return span


def as_head(head) -> int | str:
    """A head index as a Python int (numpy and torch integers too), or HEAD_MEAN."""
    if isinstance(head, str):
        if head != HEAD_MEAN:
            raise ValueError(f"head must be an index or {HEAD_MEAN!r}, got {head!r}")
        return head
    try:
        index = operator.index(head)
    except TypeError:
        raise ValueError(f"head must be an index or {HEAD_MEAN!r}, got {head!r}") from None
    return int(index)


def _snap(span: range, block: int, n: int) -> range:
    return range(span.start // block * block, min(n, -(-span.stop // block) * block))


def pool_blocks(x: torch.Tensor, rows: int, cols: int, how: str) -> torch.Tensor:
    """(R, C) -> (ceil(R / rows), ceil(C / cols)) by max or sum over blocks; zero padding is harmless because
    probabilities are never negative."""
    pad_r, pad_c = -x.shape[0] % rows, -x.shape[1] % cols
    x = F.pad(x, (0, pad_c, 0, pad_r))
    blocks = x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)
    return blocks.amax(dim=(1, 3)) if how == "max" else blocks.sum(dim=(1, 3))


def cell_counts(span: range, block: int) -> torch.Tensor:
    """Tokens in each block of a snapped span: `block`, except a last block cut by the trace's end."""
    starts = torch.arange(span.start, span.stop, block)
    return (torch.clamp(starts + block, max=span.stop) - starts).float()


class AttentionTiles:
    """Pooled and exact views of a trace's attention maps, with one exact pass per (layer, head) kept in an LRU.

    base_cells: cells per side of the stored base grid (the finest pooled level); base_block is the smallest
        power of two with n_tokens / base_block <= base_cells. Views finer than that are recomputed.
    keep: how many (layer, head) base grids stay in memory.

    The exact pass is the one slow step (seconds per full-attention head at 32k tokens on 2 CPU cores): `precompute`
    pays it up front for every head, e.g. where the trace was captured, and `save` / `AttentionTiles.load` carry the
    grids beside the trace file, so that every view on another machine opens from them.
    """

    def __init__(self, trace, *, base_cells: int = 2048, keep: int = 8, progress: bool = True):
        self.trace = trace
        self.base_block = next_power_of_two(-(-trace.n_tokens // base_cells))
        self.keep = keep
        self.progress = progress
        self._bases: OrderedDict[tuple[int, int | str], _Base] = OrderedDict()
        self._stored: dict[tuple[int, int | str], str] = {}  # grids in a saved file, read when first viewed
        self._path: str | None = None

    # ---- paying the exact pass up front, and carrying it -------------------------------------
    def precompute(self, layers=None, heads=None) -> "AttentionTiles":
        """Make the exact pass of every given (layer, head) now and keep them all (default: every recorded layer,
        every head and the head mean)."""
        layers = self.trace.layers if layers is None else [int(layer) for layer in layers]
        heads = [*range(self.trace.n_heads), HEAD_MEAN] if heads is None else [as_head(head) for head in heads]
        self.keep = max(self.keep, len(self._bases) + len(layers) * len(heads))
        for layer in progress_bar(layers, desc="exact passes (layers)", disable=not self.progress):
            for head in heads:
                self._base(layer, head)
        return self

    def fingerprint(self) -> str:
        """What a saved grid must match: the tokens, the model, the recorded layers and heads, the base block."""
        trace = self.trace
        digest = hashlib.sha256(trace.token_ids.cpu().numpy().tobytes())
        digest.update(json.dumps([trace.meta.get("model"), trace.layers, trace.n_heads, trace.n_kv_heads,
                                  trace.head_dim, self.base_block]).encode())
        return digest.hexdigest()[:16]

    def save(self, path) -> Path:
        """Write every base grid held (computed or read) to one safetensors file; returns the path."""
        for key in list(self._stored):
            self._base(*key)  # a grid read lazily from another file is carried over
        tensors = {}
        for (layer, head), base in self._bases.items():
            for part in ("max", "sum", "lse"):
                tensors[f"layers.{layer}.heads.{head}.{part}"] = getattr(base, part).contiguous()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"snapkv_lab": json.dumps(dict(
            format=_FORMAT, fingerprint=self.fingerprint(), base_block=self.base_block))})
        return path

    @classmethod
    def load(cls, trace, path, **options) -> "AttentionTiles":
        """Tiles of `trace` whose base grids come from a file written by `save` (each read when its head is first
        viewed; heads not in the file are computed as usual). A file of another trace is refused."""
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("snapkv_lab", "{}"))
            names = list(f.keys())
        if header.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a file of snapkv_lab tiles (format {header.get('format')!r})")
        n = trace.n_tokens
        tiles = cls(trace, base_cells=-(-n // header["base_block"]), **options)
        if tiles.base_block != header["base_block"] or tiles.fingerprint() != header["fingerprint"]:
            raise ValueError(f"{path} holds the tiles of another trace (another prompt, model or layers) than this one")
        for name in names:
            if name.endswith(".max"):
                _, layer, _, head, _ = name.split(".")
                tiles._stored[(int(layer), as_head(head if head == HEAD_MEAN else int(head)))] = name[: -len(".max")]
        tiles._path = str(path)
        tiles.keep = max(tiles.keep, len(tiles._stored))
        return tiles

    # ---- public views ------------------------------------------------------------------------
    def block_for(self, rows: range, cols: range, max_cells: int) -> int:
        """The block a view of rows x cols gets: the smallest power of two whose cells, once the view is snapped
        outwards to them, fit max_cells per side."""
        block = next_power_of_two(-(-max(len(rows), len(cols)) // max_cells))
        n = self.trace.n_tokens
        while max(len(_snap(rows, block, n)), len(_snap(cols, block, n))) > max_cells * block:
            block *= 2
        return block

    def view(self, layer: int, head: int | str, rows=None, cols=None, *, max_cells: int = 512,
             block: int | None = None) -> Tile:
        """The view of `rows` x `cols` (slices of token positions; None: all) of one head's map, or of the mean
        of the layer's heads (head="mean"), at most max_cells per side (or at a given power-of-two `block`)."""
        n, head = self.trace.n_tokens, as_head(head)
        rows, cols = as_span(rows, n), as_span(cols, n)
        block = self.block_for(rows, cols, max_cells) if block is None else block
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        rows, cols = _snap(rows, block, n), _snap(cols, block, n)
        if block >= self.base_block:
            block_max, block_sum = self._from_base(layer, head, rows, cols, block)
        else:
            block_max, block_sum = self._recomputed(layer, head, rows, cols, block)
        counts = torch.outer(cell_counts(rows, block), cell_counts(cols, block))
        return Tile(layer, head, rows, cols, block, block_max, block_sum / counts)

    def exact(self, layer: int, head: int | str, rows, cols) -> torch.Tensor:
        """Exact probabilities (len(rows), len(cols)) float32 of one head (or the head mean) for consecutive
        rows and columns, normalised over each row's whole span of keys."""
        n, head = self.trace.n_tokens, as_head(head)
        rows, cols = as_span(rows, n), as_span(cols, n)
        return self._probs(layer, head, rows, cols)

    # ---- the exact pass ----------------------------------------------------------------------
    def query_heads(self, head) -> range:
        """The query heads a view of `head` averages: that one, or all of them for HEAD_MEAN (checked)."""
        head = as_head(head)
        if head == HEAD_MEAN:
            return range(self.trace.n_heads)
        if not 0 <= head < self.trace.n_heads:
            raise ValueError(f"head must be 0..{self.trace.n_heads - 1} or {HEAD_MEAN!r}, got {head!r}")
        return range(head, head + 1)

    def _operands(self, layer: int, head):
        trace = self.trace
        entry = trace._entry(layer)
        heads = self.query_heads(head)
        # consecutive heads: a view of the queries, not a copy of them at every zoom
        query = trace.queries[entry][heads.start:heads.stop]
        settings = trace.attention_settings[entry]
        kv_index = torch.tensor(heads) // (trace.n_heads // trace.n_kv_heads)
        return query, trace.keys[entry], kv_index, settings

    @staticmethod
    def _width(cols: range, settings, align: int) -> int:
        """The most columns a chunk of rows needs: all of cols, or a sliding layer's window and a block."""
        return len(cols) if settings.sliding_window is None else min(len(cols), settings.sliding_window + align)

    def _row_chunks(self, rows: range, width: int, heads: int, align: int, sliding: bool):
        """Consecutive row ranges, multiples of `align` long, each holding at most BLOCK_ELEMENTS logits. A sliding
        layer's chunk sees its own rows plus a window of keys, so its rows are capped at `width` too."""
        step = max(align, BLOCK_ELEMENTS // max(1, 2 * heads * width) // align * align)
        if sliding:
            step = min(step, max(align, width // align * align))
        for start in range(rows.start, rows.stop, step):
            yield range(start, min(start + step, rows.stop))

    def _logits(self, query, key, kv_index, settings, rows: range, first: int, last: int) -> torch.Tensor:
        positions = torch.arange(rows.start, rows.stop)
        return attention_logits(query[:, rows.start:rows.stop], key, settings.scaling, positions.to(query.device),
                                first=first, last=last, kv_index=kv_index, sliding_window=settings.sliding_window,
                                softcap=settings.softcap)

    def _visible(self, rows: range, cols: range, settings, align: int) -> tuple[int, int]:
        """The columns of `cols` that rows can see, widened to multiples of `align` within cols."""
        last = min(cols.stop, rows.stop)
        first = cols.start
        if settings.sliding_window is not None:
            first = max(first, rows.start - settings.sliding_window + 1)
        first = cols.start + (first - cols.start) // align * align
        last = min(cols.stop, cols.start + -(-(last - cols.start) // align) * align)
        return first, max(first, last)

    def _base(self, layer: int, head) -> _Base:
        key = (layer, head)
        if key in self._bases:
            self._bases.move_to_end(key)
            return self._bases[key]
        if key in self._stored:
            with safe_open(self._path, framework="pt") as f:
                prefix = self._stored.pop(key)
                base = _Base(self.base_block, *(f.get_tensor(f"{prefix}.{part}") for part in ("max", "sum", "lse")))
            return self._remember(key, base)
        query, keys, kv_index, settings = self._operands(layer, head)
        n, block = self.trace.n_tokens, self.base_block
        cells = -(-n // block)
        base = _Base(block, torch.zeros(cells, cells), torch.zeros(cells, cells), torch.empty(query.shape[0], n))
        chunks = list(self._row_chunks(range(n), self._width(range(n), settings, block), query.shape[0], block,
                                        settings.sliding_window is not None))
        for rows in progress_bar(chunks, desc=f"layer {layer} head {head}: exact pass", disable=not self.progress,
                                 leave=False):
            first, last = self._visible(rows, range(n), settings, block)
            # on the trace's device (a GPU for a trace loaded there); only pooled cells come back to the host
            logits = self._logits(query, keys, kv_index, settings, rows, first, last)
            lse = torch.logsumexp(logits, dim=-1)
            base.lse[:, rows.start:rows.stop] = lse.cpu()
            probs = torch.exp_(logits.sub_(lse[..., None])).mean(0)
            cell_rows, cell_cols = (slice(rows.start // block, -(-rows.stop // block)),
                                    slice(first // block, -(-last // block)))
            base.max[cell_rows, cell_cols] = pool_blocks(probs, block, block, "max").cpu()
            base.sum[cell_rows, cell_cols] = pool_blocks(probs, block, block, "sum").cpu()
        return self._remember(key, base)

    def _remember(self, key, base: _Base) -> _Base:
        self._bases[key] = base
        while len(self._bases) > self.keep:
            self._bases.popitem(last=False)
        return base

    # ---- views from the base grid, or recomputed -----------------------------------------------
    def _from_base(self, layer, head, rows: range, cols: range, block: int):
        base = self._base(layer, head)
        factor = block // base.block
        cells_r = slice(rows.start // base.block, -(-rows.stop // base.block))
        cells_c = slice(cols.start // base.block, -(-cols.stop // base.block))
        return (pool_blocks(base.max[cells_r, cells_c], factor, factor, "max"),
                pool_blocks(base.sum[cells_r, cells_c], factor, factor, "sum"))

    def _exact_chunks(self, layer, head, rows: range, cols: range, align: int):
        """Yield (row range, first col, last col, probs (rows, last - first)) over consecutive row chunks, rows
        and column bounds multiples of `align` from the view's start; columns the chunk cannot see are skipped."""
        base = self._base(layer, head)
        query, keys, kv_index, settings = self._operands(layer, head)
        for chunk in self._row_chunks(rows, self._width(cols, settings, align), query.shape[0], align,
                                         settings.sliding_window is not None):
            first, last = self._visible(chunk, cols, settings, align)
            if first >= last:
                continue  # the chunk sees none of these keys
            logits = self._logits(query, keys, kv_index, settings, chunk, first, last)
            lse = base.lse[:, chunk.start:chunk.stop, None].to(logits.device)
            yield chunk, first, last, torch.exp_(logits.sub_(lse)).mean(0)

    def _probs(self, layer, head, rows: range, cols: range) -> torch.Tensor:
        """Exact probabilities of rows x cols, averaged over the view's heads."""
        out = torch.zeros(len(rows), len(cols))
        for chunk, first, last, probs in self._exact_chunks(layer, head, rows, cols, 1):
            out[chunk.start - rows.start: chunk.stop - rows.start, first - cols.start: last - cols.start] = probs.cpu()
        return out

    def _recomputed(self, layer, head, rows: range, cols: range, block: int):
        if block == 1:
            probs = self._probs(layer, head, rows, cols)
            return probs, probs
        cells = (-(-len(rows) // block), -(-len(cols) // block))
        block_max, block_sum = torch.zeros(cells), torch.zeros(cells)
        for chunk, first, last, probs in self._exact_chunks(layer, head, rows, cols, block):
            cell_rows = slice((chunk.start - rows.start) // block, -(-(chunk.stop - rows.start) // block))
            cell_cols = slice((first - cols.start) // block, -(-(last - cols.start) // block))
            block_max[cell_rows, cell_cols] = pool_blocks(probs, block, block, "max").cpu()
            block_sum[cell_rows, cell_cols] = pool_blocks(probs, block, block, "sum").cpu()
        return block_max, block_sum
