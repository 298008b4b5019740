"""kvpress's CaM merge while decoding: `DecodingEviction(merging="cam")`, NVIDIA kvpress 0.5.5's CAMPress
(kvpress/presses/cam_press.py), the values of evicted tokens added to kept ones instead of dropped.

CAMPress is kvpress's DecodingPress schedule (every `compression_interval` decode calls, once the layer holds more
than `target_size`, cut back to `target_size`, :285-290; nothing at prefill, :242-249) with three changes, each from
cam_press.py (kvpress 0.5.5 as installed in the peer venv; line numbers of that file):

- one kept set for every KV head: the base press's scores averaged over the KV heads, the top `target_size` kept
  (:142, :154-155), where DecodingPress keeps a set per head;
- each KV head's attention from every decode call's last query, the mean over its query heads, summed since the
  prefill (the prefill's own attention not counted) and pruned with the cache at each eviction (:258-283, :211-213);
- before the evicted leave, the k best-scored of them (k = the decode calls since the last eviction; equal scores:
  the later position first, :147-152) are each merged into the `merge_budget` (32) kept positions after it (fewer
  where the kept set ends, :159-169), by one Bernoulli draw per KV head with probability
  clamp(A_x / mean(A over those kept positions), 0, 1) from the summed attention A (nan -> 0, inf -> 1, :171-186):
  v_t += draw * v_x / (the window's size) for each position t of the window (:189-202). Keys are not changed.

Here: kvpress's CAMPress(base_press=P, compression_interval=I, target_size=T, merge_budget=B) is
`DecodingEviction(policy=P's lab scorer, capacity=None, interval=I, target=T, merging="cam", merge_budget=B)`
(capacity None: the prompt whole, as CAMPress leaves it; a capacity compresses it first, as PrefillDecodingPress
would). As under DecodingEviction, the scorer votes with the queries since the last eviction (kvpress: the last
`hidden_states_buffer_size` hidden states, 256) and the steps count tokens (kvpress: calls; the same while decoding
token by token). The attention is the model's own (its scaling, softcap and window; kvpress's plain softmax of
q k / sqrt(head_dim), :333-348, is the same on Llama and Qwen). The evicted are the slots not kept: kvpress takes
the bottom n - T and the top T separately (:144, :154), so between equal scores at the cut a slot can be kept and
merged into others while another leaves unmerged, which happens under KnormPress in layer 0, whose key norms depend
on the token alone (docs/faithfulness.md, measured beside kvpress itself). The kept tail of the scorer
(SnapKV's window) is kept as kvpress's scorers keep it, at the top score.

How it differs from the authors' CaM (Zhang et al., ICML 2024, openreview LCTmppB165; zyxxmu/cam, the lab's `CAM`):
there a StreamingLLM window loses one token per step, and the token next to leave is merged by *this step's*
attention into the 32 tokens after it, each share v_x / 32 (modify_llama_cam.py:23-35). kvpress's docstring calls
its interval-1 form "the original per-step CaM behavior" (:35-38), but even then it ranks by a scorer, not by
recency, and sums the attention over steps: another method under the name, so the lab keeps both, `CAM` the
authors' and this setting kvpress's (docs/faithfulness.md).
"""

from __future__ import annotations

import torch


def merge_into_next_kept(value: torch.Tensor, attention: torch.Tensor, ranking: torch.Tensor, kept: torch.Tensor,
                         count: int, merge_budget: int) -> torch.Tensor:
    """CAMPress's merge on one batch row's layer just before an eviction (see module doc).

    value: (kv_heads, n, head_dim) every slot's value; attention: (kv_heads, n) the attention each slot received,
    summed over the decode calls (in the values' dtype, as kvpress keeps it); ranking: (m,) the score shared by the KV
    heads of the first m slots, among which every evicted slot lies; kept: (k,) ascending, the slots kept; count: how
    many evicted slots merge at most (the decode calls since the last eviction). Draws with torch's global generator,
    one (kv_heads, merged) tensor, as kvpress draws one per layer for a batch of one.
    Returns (kv_heads, n, head_dim) the values with the kept slots' merged; `value` is left as it was."""
    n = value.shape[1]
    leaving = torch.ones(n, dtype=torch.bool, device=value.device)
    leaving[kept] = False
    evicted = leaving.nonzero().flatten()
    # The best-scored first; a stable sort over the evicted slots latest first puts the later of equal scores first.
    latest_first = evicted.flip(0)
    order = ranking[latest_first].argsort(descending=True, stable=True)[:count]
    movers = latest_first[order].sort().values
    # Each mover's window: the merge_budget kept slots after it, fewer where the kept set ends.
    first = torch.searchsorted(kept, movers, right=True)
    window = first[:, None] + torch.arange(merge_budget, device=value.device)  # (movers, merge_budget)
    inside = window < len(kept)
    targets = kept[window.clamp(max=len(kept) - 1)]
    size = inside.sum(-1)  # (movers,)
    window_mean = (attention[:, targets] * inside).sum(-1) / size.clamp(min=1)  # (kv_heads, movers)
    probability = torch.nan_to_num(attention[:, movers] / window_mean, nan=0.0, posinf=1.0).clamp(0, 1)
    draw = torch.bernoulli(probability)
    share = value[:, movers] * (draw / size.clamp(min=1))[..., None]  # (kv_heads, movers, head_dim)
    merged = value.clone()
    spread = share[:, :, None].expand(-1, -1, merge_budget, -1)[:, inside]  # (kv_heads, valid targets, head_dim)
    return merged.index_add_(1, targets[inside], spread)
