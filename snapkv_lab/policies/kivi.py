"""KIVI (Liu et al. 2024, arXiv 2402.02750, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): keys
quantized per channel, values per token, in groups, the most recent tokens kept in full precision.

Official code: jy-yuan/KIVI, models/llama_kivi.py (commit 04eeae06): at prefill (lines 170-195) the keys but the last
n mod residual_length are quantized per channel in groups of group_size tokens (quant/new_pack.py:146-175,
`triton_quantize_and_pack_along_last_dim` over the transposed keys), the values but the last residual_length per
token in groups of group_size channels; while decoding (lines 140-168) the key residual is quantized once it holds
residual_length tokens, and the value residual's oldest token once it holds more. Asymmetric min-max codes:
scale = (max - min) / (2^bits - 1), code = round((x - min) / scale) clamped (new_pack.py:160-165), stored with its
group's scale and minimum in the model's dtype. Defaults: 2 bits (KIVI-2), group size 32 and residual length 128,
the paper's (section 4.1). Ours guards a constant group (scale 0) by storing it exactly.

Over any positional policy: the positions it keeps are quantized (capacity=None, the default, keeps every position:
KIVI alone). transformers' own QuantizedCache (quanto or HQQ backends, both install and run on this CPU) quantizes
the whole cache with its backend's layout and cannot hold an evicted cache's positions: see docs/faithfulness.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .storage import Storage
from .wrapper import Wrapper


@dataclass
class KIVI(Wrapper):
    """KIVI quantization of the positions `policy` keeps (SnapKV by default; capacity=None keeps all). key_bits,
    value_bits: 2, 4 or 8, or None for full precision; group_size; residual_length (see module doc)."""

    keeps_inner_selection: ClassVar[bool] = True
    capacity: int | float | None = None
    key_bits: int | None = 2
    value_bits: int | None = 2
    group_size: int = 32
    residual_length: int = 128

    def __post_init__(self):
        super().__post_init__()
        _ = self.storage  # checks the settings now, not at the first prefill

    @property
    def storage(self) -> Storage:
        return (self.policy.storage or Storage()).wrapped(
            self, key_bits=self.key_bits, value_bits=self.value_bits, group_size=self.group_size,
            residual_length=self.residual_length)
