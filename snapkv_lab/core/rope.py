"""A layer's own rotary position embedding (RoPE), taken from its transformers modeling module.

Families rotate differently: Llama pairs dim i with i + r/2, Cohere pairs neighbours (2i, 2i + 1), GPT-NeoX, Phi
and StableLM rotate only the first r = partial_rotary_factor * head_dim dims, Gemma 3 gives its sliding and full
attention layers different bases, SmolLM3 leaves some layers unrotated (use_rope = 0), YaRN scales cos and sin.
Rather than re-implement each, `LayerRope.of(module)` uses the family's own pieces: its RotaryEmbedding class built
from the layer's config (called with the layer's type where it takes one) and its apply_rotary_pos_emb, applied to
the first r dims. Each such apply_rotary_pos_emb computes x * cos + rotate(x) * sin with rotate a fixed quarter turn
of each pair, so it is linear in (cos, sin): the inverse at a position is the same function with (cos, -sin) / (cos^2 +
sin^2), and the mean of the rotations over positions is the rotation with the mean cos and sin.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerRope:
    """One attention layer's RoPE. rotary: the family's RotaryEmbedding module, or None where the layer has no RoPE;
    apply: the family's apply_rotary_pos_emb(q, k, cos, sin); layer_type: the rotary's layer_type argument (Gemma 3);
    head_dim: dims per head, of which RoPE rotates the first `rotary_dims` (cos.shape[-1])."""

    rotary: torch.nn.Module | None
    apply: Callable | None
    layer_type: str | None
    head_dim: int

    @classmethod
    def of(cls, module, head_dim: int) -> LayerRope:
        """The RoPE of attention `module` (whose heads have `head_dim` dims). NotImplementedError for a layer whose
        RoPE this cannot reproduce (no RoPE classes in its modeling module, a forward that rotates through other
        functions, dynamic NTK scaling, a partial rotation not over the leading dims)."""
        name = type(module).__name__
        family = sys.modules[type(module).__module__]
        rotary_cls = _rotary_class(family, name)
        apply = getattr(family, "apply_rotary_pos_emb", None)
        if rotary_cls is None or apply is None:
            raise NotImplementedError(f"{name}: its modeling module {family.__name__} has no RotaryEmbedding class and "
                                      "apply_rotary_pos_emb (not a RoPE model, or one whose RoPE is not supported)")
        applied = _rope_functions_called(type(module))
        if applied != {"apply_rotary_pos_emb"}:  # DeepSeek's interleaved MLA rotation, Gemma 4's multidimensional one
            raise NotImplementedError(f"{name}: its forward applies RoPE through {sorted(applied)}, not "
                                      "apply_rotary_pos_emb alone")
        if not getattr(module, "use_rope", True):  # SmolLM3's NoPE layers
            return cls(None, None, None, head_dim)
        config = module.config
        takes_layer_type = "layer_type" in inspect.signature(rotary_cls.forward).parameters
        layer_type = config.layer_types[module.layer_idx] if takes_layer_type else None
        rotary = rotary_cls(config=config)
        rope_type = getattr(rotary, "rope_type", None)
        rope_type = rope_type[layer_type] if isinstance(rope_type, dict) else rope_type
        if rope_type == "dynamic":
            raise NotImplementedError(f"{name}: dynamic NTK RoPE changes its frequencies with the model's history")
        rope = cls(rotary, apply, layer_type, head_dim)
        partial = rope.cos_sin(torch.zeros(1, dtype=torch.long))[0].shape[-1] < head_dim
        if partial and not hasattr(module, "rotary_ndims"):  # GPT-NeoX, Phi, StableLM rotate the leading rotary_ndims
            raise NotImplementedError(f"{name}: RoPE rotates part of each head, but not the leading rotary_ndims dims")
        return rope

    def cos_sin(self, positions: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(positions), rotary_dims) float32 cos and sin at token `positions` (attention_scaling included), as the
        model computes them in a forward over those positions."""
        device = device or positions.device
        anchor = torch.zeros(1, dtype=torch.float32, device=device)  # sets the device and dtype of cos and sin
        args = (self.layer_type,) if self.layer_type is not None else ()
        cos, sin = self.rotary.to(device)(anchor, positions.to(device)[None].long(), *args)
        return cos[0].float(), sin[0].float()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (heads, rows, head_dim) through the family's rotation with (rows, rotary_dims) cos and sin; the dims
        past rotary_dims pass unchanged. Returns x's dtype and shape."""
        rotary_dims = cos.shape[-1]
        cos, sin = cos.to(x.dtype)[None], sin.to(x.dtype)[None]  # (1, rows, rotary_dims): batch of 1
        part = x[None, ..., :rotary_dims]  # (1, heads, rows, rotary_dims); one head stands in for the unused keys
        rotated = self.apply(part, part[:, :1], cos, sin)[0][0].to(x.dtype)
        return torch.cat([rotated, x[..., rotary_dims:]], dim=-1)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(heads, rows, head_dim) post-RoPE vectors at token `positions` (rows,) -> the vectors before RoPE, in x's
        dtype: the family's rotation with (cos, -sin) / (cos^2 + sin^2), its exact inverse."""
        if self.rotary is None:
            return x
        cos, sin = self.cos_sin(positions, x.device)
        norm = cos * cos + sin * sin  # attention_scaling^2 (1 but for YaRN-style scaled RoPE)
        return self._rotate(x, cos / norm, -sin / norm)

    def rerotate(self, x: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """(heads, rows, head_dim) post-RoPE vectors at token positions `old` (rows,) -> the same vectors as RoPE
        rotates them at positions `new` (rows,): back by the old position (`unrotate`), forward by the new one, in
        float32, x's dtype returned."""
        if self.rotary is None:
            return x
        cos, sin = self.cos_sin(new, x.device)
        return self._rotate(self.unrotate(x.float(), old), cos, sin).to(x.dtype)

    def mean_rotation(self, positions: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
        """(head_dim, head_dim) mean over token `positions` of the matrices R_t by which RoPE maps a pre-RoPE vector v
        to the post-RoPE R_t v; identity on the unrotated dims."""
        eye = torch.eye(self.head_dim, dtype=dtype, device=positions.device)
        if self.rotary is None:
            return eye
        cos, sin = self.cos_sin(positions)
        mean_cos, mean_sin = cos.to(dtype).mean(0, keepdim=True), sin.to(dtype).mean(0, keepdim=True)
        # Row i of the rotated identity is R e_i, the i-th column of R.
        rows = self._rotate(eye[None], mean_cos.expand(self.head_dim, -1), mean_sin.expand(self.head_dim, -1))[0]
        return rows.T


def _rope_functions_called(attention_cls) -> set[str]:
    """The names of the apply_*rotary* / apply_*rope* functions that the attention class's forward calls."""
    try:
        source = inspect.getsource(attention_cls.forward)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"\b(apply_\w*(?:rotary|rope)\w*)\s*\(", source))


def _rotary_class(family, attention_name: str):
    """The RotaryEmbedding class of a modeling module: the one named after the attention class (LlamaAttention ->
    LlamaRotaryEmbedding), else the module's only one, else None."""
    own = getattr(family, attention_name.removesuffix("Attention") + "RotaryEmbedding", None)
    if own is not None:
        return own
    candidates = [getattr(family, n) for n in dir(family) if n.endswith("RotaryEmbedding")
                  and isinstance(getattr(family, n), type)]
    return candidates[0] if len(candidates) == 1 else None
