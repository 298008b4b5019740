"""snapkv_lab beside its peer, NVIDIA kvpress 0.5.5: the prompt positions each of our policies keeps next to
those the matching kvpress press keeps, per layer and KV head, on the same token ids and the same weights (the
bundled SmolLM2-135M-Instruct, fp32, sdpa: the worker loads the very checkpoint snapkv_lab loads). Shared by
tests/test_peer.py (`pytest -m peer`) and benchmarks/kvpress_side_by_side.py.

Two environments. kvpress 0.5.5 pins transformers<5.3 and snapkv_lab runs transformers 5.23, so kvpress lives in
its own venv (scripts/kvpress_venv.sh; default_venv() says where) and snapkv_lab never imports it. Our half runs
here: one SharedPrefill serves every policy. The kvpress half is benchmarks/_kvpress_worker.py, run once in the
venv for every press (one process, one model load), on the ids we send it.

The prompt: the chat template's text before a user message (system prompt, user turn), then Paul Graham's
essays, as kvpress's pipeline builds a context (kvpress/pipeline.py:140-152); KVzipPress counts on that prefix.
Budgets: kvpress keeps n_kept = max(1, int(n * (1 - compression_ratio))) per KV head (kvpress/utils.py:104-114);
ours keep `capacity` per KV head, window included, so capacity = n_kept (250 of 1000 at ratio 0.75).

ROWS: one per method both projects have. Where both follow the same definition, the defaults are compared;
where a difference remains by design, the row sets our documented variant parameter to kvpress's choice, so
that every gap left is a named parameter. SnapKV-family rows give both sides kvpress's window_size 64 and
kernel_size 5. A row may rely on what our policies do not do yet (Row.pending, Row.expect): it is then
*pending*, reported but never asserted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch

WORKER = Path(__file__).resolve().parent / "_kvpress_worker.py"
N_TOKENS, RATIO = 1000, 0.75
WINDOW, KERNEL = 64, 5  # kvpress's SnapKVPress defaults (snapkv_press.py:38-39), given to both sides
# inner scorer of wrappers: kvpress's SnapKVPress
SNAP = f"SnapKV(pooling='avg', kernel_size={KERNEL}, window_size={WINDOW})"
SNAP_PRESS = f"SnapKVPress(compression_ratio={{ratio}}, window_size={WINDOW}, kernel_size={KERNEL})"
_ABSENT = object()
# The PerLayer row's compression ratio per layer (kvpress) and the capacities they keep of N_TOKENS (ours; None: the
# wrapper's capacity, the row's RATIO).
PER_LAYER_RATIOS = [0.5] * 10 + [RATIO] * 10 + [0.875] * 10
PER_LAYER_OURS = tuple([int(N_TOKENS * 0.5)] * 10 + [None] * 10 + [int(N_TOKENS * 0.125)] * 10)
# The LUKV row's budget curve, handed to both sides (kvpress would download Llama-3.1-8B's alone): seeded prune ratios,
# each row's ratio +- 0.15 per layer and KV head (`lukv_curve`), written where the row's expression reads it.
LUKV_CURVE = Path(tempfile.gettempdir()) / "snapkv_lab_peer_lukv_curve.npy"


def lukv_curve(layers: int, kv_heads: int, path: Path = LUKV_CURVE, seed: int = 0) -> Path:
    """Write a (99, layers, kv_heads) float32 LU-KV budget curve to `path`: at ratio r = (i + 1) / 100, prune ratios
    drawn uniformly from [r - 0.15, r + 0.15] within [0, 0.99], seeded."""
    ratios = numpy.arange(1, 100)[:, None, None] / 100
    drawn = numpy.random.default_rng(seed).uniform(-0.15, 0.15, (99, layers, kv_heads))
    numpy.save(path, numpy.clip(ratios + drawn, 0, 0.99).astype(numpy.float32))
    return path


# The FastKVzip rows' gates, handed to both sides (kvpress would download the published ones, for 7-8B models only):
# seeded gates of the model's shapes (`fastkvzip_gates`), written where the rows' expressions read them.
FASTKVZIP_GATES = Path(tempfile.gettempdir()) / "snapkv_lab_peer_fastkvzip_gates.safetensors"


def fastkvzip_gates(model, path: Path = FASTKVZIP_GATES, seed: int = 0) -> Path:
    """Write seeded Fast KVzip gates for every layer of `model` to `path` (`Gates.drawn`), in the file format
    snapkv_lab's FastKVzip reads."""
    from snapkv_lab.policies.fastkvzip import Gates

    config = model.config
    Gates.drawn(list(range(config.num_hidden_layers)), config.hidden_size, config.num_key_value_heads,
                config.num_attention_heads // config.num_key_value_heads, seed).save(path, {"seed": seed})
    return path


@dataclass(frozen=True)
class Row:
    """One method side by side.

    ours: our policy as a Python expression over snapkv_lab.POLICIES (capacity is set to n_kept).
    press: the kvpress press, an expression over kvpress's names; {ratio} is filled in, and {head_ratio}, the share
        of streaming heads our DuoAttention chose (duo_pattern).
    why: why the two keep the same positions (kvpress and snapkv_lab code lines).
    pending: what our side still lacks for the row to hold, when it is a change of behaviour that no field shows
        ("" once it has landed: delete the text then).
    expect: fields of our built policy the row relies on, by dotted path ("policy.sinks"), with the values the
        target API gives them (new defaults included): until our policy has them the row is pending too.
    values: compare the kept values too, not only the positions (merging presses rewrite them): Agreement.value_gap.
    """

    label: str
    ours: str
    press: str
    why: str
    pending: str = ""
    expect: dict = field(default_factory=dict)
    values: bool = False


ROWS = [
    Row("SnapKV", f"SnapKV(pooling='avg', window_size={WINDOW}, kernel_size={KERNEL})", SNAP_PRESS,
        "Same definition: the last 64 queries' softmax over every key (causal inside the window), pooled along "
        "positions per query head, averaged over each GQA group; the window is kept, inside the budget "
        "(kvpress pads its scores with max+1, snapkv_press.py:103). By design kvpress pools with avg_pool1d "
        "(snapkv_press.py:96) where the paper's code uses max: ours pooling='avg'. Both average the window's votes "
        "(:95; the paper sums them, the same order)."),
    Row("StreamingLLM", "StreamingLLM()", "StreamingLLMPress(compression_ratio={ratio})",
        "Same definition and defaults: the n_sink = 4 first positions and the most recent n_kept - 4 "
        "(streaming_llm_press.py:50-52); ours splits the recent ones into prefix picks and the window, the same set."),
    Row("KNorm", "KNorm()", "KnormPress(compression_ratio={ratio})",
        "Same definition and defaults: the keys of lowest L2 norm per KV head (knorm_press.py:46), every position "
        "competing, no window (the paper keeps none).", expect={"kept_tail": 0}),
    Row("TOVA", "TOVA(kept_tail=1, interval=None)", "TOVAPress(compression_ratio={ratio})",
        "Same definition: the last query's attention averaged over all query heads, one selection per layer shared "
        "by its KV heads (tova_press.py:53-54; TOVA's code, per_layer=True). By design kvpress keeps the last token "
        "(padded with max+1, :59): ours kept_tail=1; and compresses once, after prefill: ours interval=None.",
        expect={"per_layer": True}),
    Row("PyramidKV", f"PyramidKV(pooling='avg', window_size={WINDOW}, kernel_size={KERNEL}, schedule='kvpress')",
        f"PyramidKVPress(compression_ratio={{ratio}}, window_size={WINDOW}, kernel_size={KERNEL})",
        "SnapKV's scores (as the SnapKV row), kvpress's layer budgets by design (pyramidkv_press.py:70-86): ours "
        "schedule='kvpress'. The smallest, n_kept / beta = 12.5, is below the window, so kvpress falls back to a "
        "flat round(n * (1 - ratio)) = 250 (:79-81), as ours.",
        expect={"schedule": "kvpress"}),
    Row("PyramidKV beta=3", f"PyramidKV(pooling='avg', window_size={WINDOW}, kernel_size={KERNEL}, beta=3, "
        "schedule='kvpress')",
        f"PyramidKVPress(compression_ratio={{ratio}}, window_size={WINDOW}, kernel_size={KERNEL}, beta=3)",
        "As the row above with beta 3, where kvpress's pyramid applies: the smallest layer budget 250 / 3 = 83 holds "
        "the window; layer totals round(max_num - l * steps), 417 down to 83 (pyramidkv_press.py:72-86).",
        expect={"schedule": "kvpress"}),
    Row("AdaKV", f"AdaKV(policy={SNAP}, allocation='safeguard')", f"AdaKVPress(press={SNAP_PRESS})",
        "kvpress's allocation by design (ours allocation='safeguard'): each head's top int(alpha * n_kept) scores "
        "first, then one top-k of kv_heads * n_kept over the layer's heads (adakv_press.py:64-80), the window "
        "winning through the inner press's max+1 pad. kvpress's safeguard counts the window: int(0.2 * 250) = 50 "
        "positions, all inside the 64-token window, so it protects no prefix position: ours "
        "max(0, int(alpha * B) - W).",
        expect={"allocation": "safeguard"}),
    Row("ChunkKV", f"ChunkKV(policy={SNAP}, chunk_size=20)",
        f"ChunkKVPress(press={SNAP_PRESS}, chunk_length=20)",
        "Same definition (kvpress's is the authors' code): chunks tile the whole prompt from position 0, ranked by "
        "the mean of the inner scores summed over KV heads (chunkkv_press.py:86-100), one choice for every head; "
        "max(1, int(n_chunks * (1 - ratio))) whole chunks kept (:103), the window's first: 12 of 50 = 240 "
        "positions. kvpress's chunk_length 20 where the paper's is 10: ours chunk_size=20.",
        expect={"per_head": False, "exact_budget": False}),
    Row("CriticalKV", f"CriticalKV(policy={SNAP})", f"CriticalKVPress(press={SNAP_PRESS})",
        "Same two stages (kvpress's is the authors' code): stage 1 keeps int(first_stage_ratio * n_kept) = 125 "
        "highest scores, the window's 64 among them (criticalkv_press.py:83-88); stage 2 fills n_kept by "
        "(score + epsilon) * ||W_o v||_1 averaged over the GQA group (:59-76, 91-95), epsilon 1e-4 on SnapKV's "
        "votes averaged over the window (snapkv_press.py:95), as ours."),
    Row("ExpectedAttention", "ExpectedAttention()", "ExpectedAttentionPress(compression_ratio={ratio})",
        "Same definition and defaults: Gaussian statistics of the pre-RoPE queries after the 4 sinks, RoPE averaged "
        "over the next 512 positions, a softmax over the keys after the sinks (expected_attention_press.py:"
        "136-152) averaged per GQA group, times ||v||; the sinks kept (:163), no window.",
        expect={"kept_tail": 0}),
    Row("RandomPress", "RandomKeep(seed=0, kept_tail=0, layer_seeds=False)",
        "RandomPress(compression_ratio={ratio}, seed=0)",
        "By design kvpress draws torch.rand(batch, kv_heads, n) from a generator seeded with `seed` in every layer "
        "(random_press.py:43-46), the same draw in every layer: ours layer_seeds=False; and every position "
        "competes: ours kept_tail=0.", expect={"layer_seeds": False}),
    Row("KVzip", "KVzip(sinks=4, chunk_size=2048, repeat_prompts='kvpress')", "KVzipPress(compression_ratio={ratio})",
        "Same scores by design (ours sinks=4, chunk_size=2048; the official code protects the whole system prompt "
        "and reconstructs chunks of 2000): the context after the chat template's head is fed again after "
        "'\\n\\nRepeat the previous context exactly.' and the template's tail (kvzip_press.py:100-121, 250-262); a "
        "position's score is the largest attention a reconstruction query pays it, over the query heads of its KV "
        "head, the softmax over the 4 sinks, the context after the head and the reconstruction only (:295-313, "
        "340-360); the head's positions after the sinks are never scored (0 from :236-248: evicted first), the sinks "
        "always kept (:376); no window. kvpress's default layerwise=False keeps the highest scores over all layers and "
        "heads at once (:383-387), as the official _threshold (snu-mllab/KVzip attention/score.py). Later chunks are "
        "fed after '...starting with' and the previous chunk's last 8 tokens (:259-268): kvpress drops the space "
        "the official instruction has after 'with' (model/wrapper.py:214): ours repeat_prompts='kvpress'.",
        expect={"sinks": 4, "chunk_size": 2048, "kept_tail": 0, "repeat_prompts": "kvpress"}),
    Row("KVzip, chunks of 300", "KVzip(sinks=4, chunk_size=300, repeat_prompts='kvpress')",
        "KVzipPress(compression_ratio={ratio}, chunk_size=300)",
        "As the KVzip row, with the context reconstructed in chunks of 300 on both sides (kvzip_press.py:226-243, "
        "our reconstruction_feeds): every chunk after the first quotes the previous one's last 8 tokens.",
        expect={"sinks": 4, "chunk_size": 300, "kept_tail": 0, "repeat_prompts": "kvpress"}),
    Row("KVzip layerwise",
        "AdaKV(policy=KVzip(sinks=4, chunk_size=2048, repeat_prompts='kvpress', allocation='uniform'), "
        "alpha_safeguard=0.0)",
        "KVzipPress(compression_ratio={ratio}, layerwise=True)",
        "As the row above, but layerwise=True evicts the lowest kv_heads * n * ratio scores of each layer over its "
        "heads (kvzip_press.py:380-405): AdaKV's top-k over the heads, with no safeguard (KVzip has none, :372).",
        expect={"policy.sinks": 4, "policy.chunk_size": 2048, "policy.repeat_prompts": "kvpress",
                "policy.kept_tail": 0}),
    Row("AdaKV(ExpectedAttention)", "AdaKV(policy=ExpectedAttention(), allocation='safeguard')",
        "AdaKVPress(press=ExpectedAttentionPress(compression_ratio={ratio}))",
        "AdaKV's allocation (as the AdaKV row) over Expected Attention's scores (as its row), no window: kvpress's "
        "safeguard int(0.2 * n_kept) = 50 per head (adakv_press.py:66), the 4 sinks among them, is ours "
        "max(0, int(0.2 * capacity) - window) = 50, as there is no window.", expect={"allocation": "safeguard"}),
    Row("CriticalAdaKV", f"CriticalKV(policy=AdaKV(policy={SNAP}, allocation='safeguard'))",
        f"CriticalAdaKVPress(press={SNAP_PRESS})",
        "AdaKV's head budgets (as the AdaKV row, criticalkv_press.py:153-171), then CriticalKV's two stages inside "
        "each head's budget, the window in its stage 1 (:173-186); epsilon as in the CriticalKV row.",
        expect={"policy.allocation": "safeguard"}),
    Row("KeyDiff", "KeyDiff()", "KeyDiffPress(compression_ratio={ratio})",
        "Same definition and defaults: minus the cosine similarity of each post-RoPE key to the mean of the layer's "
        "unit-normalised keys, per KV head (keydiff_press.py:45-46), every position competing, no window."),
    Row("LagKV", "LagKV(sinks=4)", "LagKVPress(compression_ratio={ratio})",
        "Same definition: partitions of 128 after the sinks, each judged against the next by the softmax of its "
        "min-max normalised channels' std, keys and values together (lagkv_press.py:65-97); ranked within each "
        "partition (:77-78), so each judged partition keeps an equal share; the sinks and the tail (the last whole "
        "partition and the rest) always kept (:81-85). By design kvpress keeps 4 sinks where the authors' code keeps "
        "16: ours sinks=4. At 1000 tokens: 7 partitions, 6 judged, 232 sinks and tail, 3 tokens per partition."),
    Row("QFilters", "QFilters()", "QFilterPress(compression_ratio={ratio})",
        "Same scoring given the same filters: kvpress loads the authors' published filters from the Hub (out of reach "
        "here), so the worker is handed ours, negated (it keeps the lowest <f, k>, qfilter_press.py:176-178); the row "
        "checks the selection, not the calibration (tests/test_attention_free.py checks that against an SVD)."),
    Row("DuoAttention", "DuoAttention(sink_size=16, recent_size=64)", "DuoAttentionPress()",
        "Same head pattern, same positions: kvpress loads the published gates from the web (out of reach here), so the "
        "worker is handed our choice of streaming heads (from the retrieval scores and the budget: 250 positions pay "
        "for 16 of 90 KV heads in full beside 80 per streaming head), and masks [sink_size:-recent_size] of the "
        "streaming heads' keys (duo_attention_press.py:113-115) where ours drops them; the row checks the positions, "
        "not the choice of heads (the next row and tests/test_head_budgets.py check that)."),
    Row("DuoAttention, kvpress's head choice", "DuoAttention(sink_size=16, recent_size=64)",
        "DuoAttentionPress(head_compression_ratio={head_ratio})",
        "The same gates, each side choosing its own heads: the worker hands kvpress our gates (a KV head's mean "
        "retrieval score) in place of the published pattern, and the share of streaming heads our budget gives (74 of "
        "90 at 250 positions); kvpress streams the round(90 x share) lowest gates (duo_attention_press.py:86-90), ours "
        "keeps the highest in full. One head chosen differently costs its layer about 0.9 / 3 of Jaccard: the row "
        "fails."),
    Row("Merging", f"Merging(policy={SNAP})", f"MergingPress(press={SNAP_PRESS})",
        "Same definition and defaults (kvpress's is the method's own code): the inner SnapKV keeps the positions (as "
        "the SnapKV row); each evicted value is folded into the kept value of its most cosine-similar key with weight "
        "max(cos, 0) |v_e| / (|v_e| + |v_t| + 1e-6), v_t' = (v_t + sum w v_e) / (1 + sum w) "
        "(merging_press.py:137-174), similarity_threshold 0.0 and merge_fraction 1.0. The kept values are compared too "
        "(value_gap).", values=True),
    Row("LeverageScore", "LeverageScore(seed=0)", "seeded(LeverageScorePress(compression_ratio={ratio}), seed=0)",
        "Same definition and defaults: ridge leverage (lambda 1e-2) of the sequence-centred pre-RoPE keys sketched by "
        "a 48-column Gaussian (leverage_press.py:75-100), every position competing, no window. kvpress draws the "
        "sketch from torch's global generator: the worker seeds it with seed * 100_003 + layer before each layer, our "
        "generator's seed. Our pre-RoPE keys are the cached keys un-rotated, kvpress's k_proj re-run (the same vectors "
        "to float rounding). Measured 2026 (this prompt): 1.000 in layers 1-29, 0.997 in layer 0, where a repeated "
        "token has the very same pre-RoPE key, so kvpress's KV head 1 ties exactly at its 250th/251st score "
        "(0.0576801) and the un-rotation's rounding picks the other twin: a tie, not a difference of method."),
    Row("NonCausalAttn", "NonCausalAttn()", "NonCausalAttnPress(compression_ratio={ratio})",
        "Same definition and defaults: each query attends to every key of its 256-position chunk, unscaled logits, "
        "the last chunk's padding as kvpress pads it (non_causal_attention_press.py:75-101; ours mask_padding=False), "
        "summed over the chunk's queries, averaged per GQA group, times ||v||, avg-pooled over 3 (:123-126)."),
    Row("Compactor", "Compactor(seed=0)", "seeded(CompactorPress(compression_ratio={ratio}), seed=0)",
        "Same definition and defaults: 8 sinks and 4 last positions kept (compactor_press.py:117-136), between them "
        "blending * z(leverage) + z(non-causal attention) with blending = the compression ratio 0.75 (:133), ours "
        "1 - capacity / n = 0.75; the sketch seeded as in the LeverageScore row."),
    Row("CUR", "CUR()", "CURPress(compression_ratio={ratio})",
        "Same definition and defaults: ||k||^2 and ||v||^2 of the cached keys and values, each a share of its window "
        "of 16 from position 0 (cur_press.py:46-55, ours window_alignment='start'), their product normalised, the 4 "
        "sinks kept (:57-69), no window."),
    Row("CUR, random projection", "CUR(random_projection=True, seed=0)",
        "seeded(CURPress(compression_ratio={ratio}, use_random_leverage=True), seed=0)",
        "As the CUR row after a shared Gaussian projection of keys and values to 20 dims (cur_press.py:37-41), drawn "
        "from torch's global generator, which the worker seeds with seed * 100_003 + layer, our generator's seed."),
    Row("Cap", "Cap()", "CapPress(compression_ratio={ratio})",
        "Same definition and defaults: per query head the mean pre-RoPE query after the 4 sinks rotated by RoPE "
        "averaged over the next 512 positions (cap_press.py:101-181), weights exp(5 (cos - max)) of the keys after "
        "the sinks (:183-219), scores w * v^T (I + sum (w + 1e-6) v v^T)^-1 v averaged per GQA group (:262-289), the "
        "sinks kept (:295), no window."),
    Row("ObservedAttention", "ObservedAttention()", "ObservedAttentionPress(compression_ratio={ratio})",
        "Same definition and defaults: every prompt query's attention to a key summed, divided by the n - j queries "
        "that see key j, averaged per GQA group (observed_attention_press.py:46-51), every position competing, no "
        "window (scorer_press.py:95-98). The press reads eager attention weights: the worker runs it alone under "
        "eager attention (run_eager)."),
    Row("Finch", f"Finch(window_size={WINDOW})",
        f"with_window(FinchPress(compression_ratio={{ratio}}, rerotate_keys=False), {WINDOW})",
        "Same definition and defaults (kvpress's is the authors' code): the window's softmax over every key, row i "
        "multiplied by i (finch_press.py:73-76), averaged over the window and each GQA group (:79-81), no pooling, "
        "the window kept (:84). The window is the question, the tokens after a delimiter (:139-153): the worker "
        "sets it to the last 64 tokens (with_window) where the pipeline would count them, ours window_size=64. "
        "rerotate_keys=False: the default re-rotates the kept keys to consecutive positions (:113-116), the same "
        "positions kept, but keys the worker can no longer match with the full ones."),
    Row("EntropyGatedChunkKV", f"EntropyGatedChunkKV(policy={SNAP})", f"EntropyGatedChunkKVPress(press={SNAP_PRESS})",
        "Same definition and defaults (kvpress's own method): SnapKV's scores with the window at max + 1 "
        "(snapkv_press.py:103; ours puts the largest finite score + 1 on the kept tail), summed over KV heads; chunks "
        "of 10 by mean, those at or above the median mean with entropy under the median cut to their 4 best, the "
        "rest of the 250 to the best left (entropy_gated_chunkkv_press.py:71-142), one set for every head."),
    Row("KVgrad", "KVgrad()", "KVgradPress(compression_ratio={ratio})",
        "Same definition and defaults: KVzip's reconstruction (as the KVzip row: 4 sinks, kvpress's repeat prompt) in "
        "chunks of 512 (kvgrad_press.py:100), one forward and one backward per chunk; a position's score is the max "
        "over reconstruction tokens and each KV head's query heads of A x ||v W_O||_2 x ||grad of sum ||h^L||^2 at the "
        "layer's attention output|| (:247-272), one selection over all layers and heads (kvzip_press.py:383-387)."),
    # Layer-level and threshold budgets (issue 54).
    Row("SimLayerKV", "SimLayerKV(lazy_threshold=0.9)", "SimLayerKVPress(lazy_threshold=0.9, n_recent=247)",
        "Same prefill decision: the last prompt query's softmax over every key, averaged over all query heads, summed "
        "over the 4 first keys and the n_recent keys before it (simlayerkv_press.py:65-69, snapkv_press.py:58-66); a "
        "layer above the threshold keeps its 4 first and last n_recent - 1 positions (:116-117), the others all. "
        "Our capacity is what a lazy layer keeps, 250 = 4 + n_recent - 1: n_recent 247. Threshold 0.9 on both sides "
        "(the authors' Llama-3 value; kvpress's default 1.0 compresses nothing)."),
    Row("DMS", f"DMS(policy={SNAP}, threshold=2e-3)",
        f"DMSPress(press={SNAP_PRESS}, threshold=2e-3, sliding_window_size=128)",
        "Same definition (kvpress's dense prefill, no trained evictors): SnapKVPress's scores (as the SnapKV row), "
        "every position before the last 128 evicted per KV head where below the threshold (dms_press.py:96-110), "
        "masked (AdaKV-style) there, dropped here. The side by side sets our capacity to 250, which caps each head's "
        "picks outside the window (ours, not kvpress's); at threshold 2e-3, twice the uniform share, no head reaches "
        "it."),
    Row("KVzap", "KVzap(model_type='linear')", "KVzapPress(compression_ratio={ratio}, model_type='linear')",
        "Same weights, same scores: kvpress would fetch nvidia/KVzap-linear-<model> from the Hub (weights for 8B "
        "models only, out of reach here), so the worker hands KVzapPress the linear surrogate the lab trained for "
        "SmolLM2 (snapkv_lab/policies/weights/kvzap/, scripts/train_kvzap.py), loaded into kvpress's own KVzapModel "
        "(same parameter names). Both score every position by that layer's module on the attention's input hidden "
        "states (kvzap_press.py:70-82) and keep the top n_kept per KV head, no window (ScorerPress; ours kept_tail 0). "
        "The MLP (kvpress's default model_type) is trained on the machine, not shipped: compared the same way by "
        "model_type='mlp' on both sides once scripts/train_kvzap.py --model-type mlp has run."),
    Row("FastKVzip", f"FastKVzip(weights={str(FASTKVZIP_GATES)!r})", "FastKVzipPress(compression_ratio={ratio})",
        "Same gates, same inference: kvpress would fetch the published gates from the Hub (7-8B models only), so both "
        "sides read one seeded set (`fastkvzip_gates`; the worker loads it into kvpress's own FastKVzipGate, same "
        "parameter names). Each layer's gate scores every position from the attention's input hidden states "
        "(fastkvzip_press.py:25-73, :207-213); the first 4 and the last max(1, int(1000 x 0.02)) = 20 positions kept "
        "(:214-226); one bottom count of int(30 x 3 x 1000 x 0.75) = 67500 over every layer and KV head (:240-247), "
        "ours one top count of 250 x 30 x 3 = 22500, the same; the layers ragged, kvpress's masked."),
    Row("FastKVzip layerwise", f"AdaKV(policy=FastKVzip(weights={str(FASTKVZIP_GATES)!r}, allocation='uniform'), "
        "alpha_safeguard=0.0)",
        "FastKVzipPress(compression_ratio={ratio}, layerwise=True)",
        "As the FastKVzip row, each layer its own count: kvpress prunes int(3 x 1000 x 0.75) = 2250 per layer, bottom "
        "k over its KV heads together (fastkvzip_press.py:237-239, :253-256), so the heads of a layer share its "
        "budget: AdaKV's per-layer selection without its safeguard (alpha_safeguard=0) over FastKVzip's scores, not "
        "FastKVzip(allocation='uniform') alone, which gives every head 250."),
    # kvpress's wrappers around any press (issue 54).
    Row("PerLayer", f"PerLayer(policy={SNAP}, layer_capacities={PER_LAYER_OURS})",
        f"PerLayerCompressionPress(press={SNAP_PRESS}, compression_ratios={PER_LAYER_RATIOS})",
        "Same definition: kvpress runs its press in layer l at compression_ratios[l] (per_layer_compression_press.py:"
        "60-65), ours the inner policy at layer_capacities[l]: layers 0-9 at ratio 0.5 (500 positions), 10-19 at the "
        "row's 0.75 (our None: the wrapper's capacity 250), 20-29 at 0.875 (125), each SnapKV as in the SnapKV row."),
    Row("PerChunk", "PerChunk(policy=KeyDiff(), chunk_size=300)",
        "ChunkPress(press=KeyDiffPress(compression_ratio={ratio}), chunk_length=300)",
        "Same definition: chunks of 300 from position 0, each scored alone by its press (chunk_press.py:76-85; KeyDiff "
        "as in the KeyDiff row, its anchor the mean unit key of the chunk) and kept at int(L * 0.25) = 75, 75, 75 and "
        "25 (:86-88), ours floor(250 L / 1000), the same. KeyDiff reads no query: kvpress's SnapKVPress inside "
        "ChunkPress rotates every chunk's window queries by the prompt's last positions (snapkv_press.py:57-58, "
        "position_embeddings of the whole prefill), where ours rotate them by their own (docs/faithfulness.md)."),
    Row("Composed", f"Composed(policy=KNorm(), before=({SNAP[:-1]}, capacity={N_TOKENS // 2}),))",
        f"ComposedPress(presses=[{SNAP_PRESS.format(ratio=0.5)}, KnormPress(compression_ratio=0.5)])",
        "Same definition: each press's hook runs on what the one before left (composed_press.py:59-63): SnapKV keeps "
        "500 (as the SnapKV row), then KNorm the 250 keys of lowest norm among them, per KV head; ours the stages of "
        "`before` at their own capacity (500), then the policy at the wrapper's (250). KNorm reads keys alone: "
        "kvpress's pruned keys are in top-k order, not position order, which a later SnapKV would read "
        "(docs/faithfulness.md). Measured 2026 (this prompt): 1.000 in layers 1-29, 0.997 in layer 0, where KV heads "
        "0 and 1 hold two keys of exactly equal norm at the 250th/251st (a repeated token: the same pre-RoPE key, "
        "and RoPE keeps norms), which each side's top-k breaks its own way: a tie, not a difference of method."),
    Row("KeyRerotation", f"KeyRerotation(policy={SNAP})", f"KeyRerotationPress(press={SNAP_PRESS})",
        "Same definition: the inner press's top n_kept by its scores, sorted (key_rerotation_press.py:145-149), the "
        "SnapKV row's positions; then the kept keys re-rotated (:150), which changes no position. The worker reads "
        "the indices the press re-rotates (read_rerotation), its keys matching no full key any more. kvpress puts "
        "kept key i at position i and decodes from the cache's length (pipeline.py:237-238), ours at n - k + i and "
        "decodes from n: the same query-key distances (tests/test_key_rerotation.py)."),
    Row("Blockwise", "Blockwise(policy=KeyDiff(), block_size=128)",
        "BlockPress(press=KeyDiffPress(compression_ratio={ratio}), block_size=128)",
        "Same definition: the first 250 positions held, then per block of 128 from there the held ones and the block "
        "scored together by KeyDiff (its anchor the mean unit key of those keys, keydiff_press.py:45-46) and the top "
        "250 held (block_press.py:67-94). KeyDiff reads keys alone: kvpress's gathered hidden states (:79-87), which "
        "a query-reading press would re-project, play no part."),
    Row("ExpectedAttention, precomputed statistics", "ExpectedAttention(statistics='shipped')",
        "ExpectedAttentionStatsPress(compression_ratio={ratio})",
        "Same definition: ExpectedAttentionPress's closed form (as the ExpectedAttention row) with the query mean and "
        "covariance read from precomputed statistics instead of the prompt's (expected_attention_with_stats.py:60-67). "
        "kvpress would load them from the Hub (:72-81); the worker hands it the lab's file, made by kvpress's recipe "
        "(policies/query_statistics.py), so both read the same numbers.",
        expect={"kept_tail": 0}),
    Row("LUKV", f"LUKV(curve={str(LUKV_CURVE)!r})",
        "LUKVPress(press=ExpectedAttentionPress(epsilon=2e-2), compression_ratio={ratio})",
        "Same definition and defaults (sink 4, window 1, ExpectedAttention with epsilon 0.02) under one curve on both "
        "sides (`lukv_curve`: kvpress's LUKVPress would download Llama-3.1-8B-Instruct's, for another model; the "
        "worker hands it this one): row 74 of the curve for ratio 0.75, each KV head's keep count from its prune "
        "ratio, the layer's rounded total, the remainder to the largest fractions (lukv_press.py:141-169), the top "
        "of ExpectedAttention's scores with the protected positions first (:133-139, :175); the layers ragged, "
        "kvpress's masked."),
    Row("KVCompose", "KVCompose()", "KVComposePress(compression_ratio={ratio})",
        "Same definition and defaults (kvpress's is the authors' code): the prompt fed again over its cache at the "
        "positions after it (kvcompose_press.py:392-420), each query head's largest attention from those tokens, "
        "meaned per GQA group, plus the mean over KV heads (:198-246); the KV heads' sorted scores meaned into "
        "composite scores, layer 0's the largest of every layer's, one top count of int(30 x 1000 x 0.25) = 7500 = "
        "our 250 x 30 over them, each layer at least 1 (:248-292), each KV head its layer's count of its best "
        "(:294-320); no window. The press runs alone (run_kvcompose): it patches the model's forward."),
    Row("KVCompose unstructured", "KVCompose(structured=False)",
        "KVComposePress(compression_ratio={ratio}, structured=False)",
        "As the KVCompose row, the variant that gives each KV head its own count: one top count of "
        "int(30 x 3 x 1000 x 0.25) = 22500 = our 250 x 90 over every head's scores (kvcompose_press.py:277-282), no "
        "layer-0 rule; kvpress masks the rest (:344-364), ours stores ragged layers."),
]


def default_venv() -> Path:
    """$KVPRESS_VENV, else kvpress-venv in snapkv_lab's cache folder ($SNAPKV_LAB_CACHE, else ~/.cache/snapkv_lab),
    as scripts/kvpress_venv.sh."""
    if os.environ.get("KVPRESS_VENV"):
        return Path(os.environ["KVPRESS_VENV"])
    return Path(os.environ.get("SNAPKV_LAB_CACHE", Path.home() / ".cache" / "snapkv_lab")) / "kvpress-venv"


def venv_problem(venv: Path) -> str | None:
    """Why the kvpress venv cannot serve, or None."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no kvpress venv at {venv}: build it with `bash scripts/kvpress_venv.sh` (or set KVPRESS_VENV)"
    check = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('kvpress'))"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        return f"the venv at {venv} has no kvpress: rebuild it with `bash scripts/kvpress_venv.sh`"
    return None


def n_kept(n: int, ratio: float) -> int:
    """kvpress.utils.compute_n_kept, for 0 <= ratio < 1."""
    return max(1, int(n * (1 - ratio)))


def prompt_ids(tokenizer, n_tokens: int) -> list[int]:
    """n_tokens ids: the chat template's head (up to the user message's content), then essays (see module doc)."""
    from snapkv_lab.core.framing import chat_frame
    from snapkv_lab.core.tokens import encode
    from snapkv_lab.tasks.corpus import haystack_ids

    head = encode(tokenizer, chat_frame(tokenizer)[0])
    return head + haystack_ids(tokenizer, n_tokens - len(head))


def build(expression: str, capacity: int):
    """Our policy from its expression, with `capacity` (a wrapper hands it on to the policy it wraps)."""
    import snapkv_lab

    policy = eval(expression, dict(snapkv_lab.POLICIES))  # noqa: S307 (expressions come from ROWS)
    return dataclasses.replace(policy, capacity=capacity)


def field_path(policy, path: str):
    for name in path.split("."):
        policy = getattr(policy, name, _ABSENT)
    return policy


def our_policy(row: Row, capacity: int):
    """(policy to measure, pending reason or None): every row builds as written; it is pending while it says so
    or while the built policy lacks a field value of `expect`."""
    reasons = [row.pending] if row.pending else []
    policy = build(row.ours, capacity)
    for path, want in row.expect.items():
        have = field_path(policy, path)
        if have != want:
            reasons.append(f"needs {path}={want!r} (today: {'absent' if have is _ABSENT else repr(have)})")
    return policy, "; ".join(reasons) or None


def duo_pattern(policy, n_tokens: int) -> dict:
    """Our prepared DuoAttention's choice on an n-token prompt, as DuoAttentionPress takes it: the streaming KV heads
    (layers x KV heads, bool), the gates they were chosen by (layers x KV heads) and the share of streaming heads, for
    a press that chooses its own; sink and recent sizes."""
    streaming = ~policy.full_head_mask(n_tokens)
    return {"streaming": streaming.tolist(), "gates": policy.gates.tolist(),
            "head_ratio": float(streaming.sum()) / streaming.numel(), "sink_size": policy.sink_size,
            "recent_size": policy.recent_size}


def run_ours(model, tokenizer, ids: list[int], policies: dict, values=()) -> tuple[dict, torch.Tensor, dict]:
    """({label: per layer (kv_heads, kept) long, -1 padded}, (vocab,) last logits of the uncompressed prefill,
    {label: per layer (kv_heads, kept, head_dim) the stored values} for the labels in `values`, and for each of them
    under label + " (uncompressed)" the full cache's values at the same positions): one SharedPrefill for every
    policy, each state as `compress` builds it."""
    from snapkv_lab.compression import SharedPrefill

    shared = SharedPrefill.run(model, tokenizer, torch.tensor([ids], device=model.device), list(policies.values()))
    n_layers = model.config.num_hidden_layers
    kept, stored = {}, {}
    for label, policy in policies.items():
        state = shared.state(policy)
        kept[label] = [state.kept_indices[layer][0].long().cpu() for layer in range(n_layers)]
        if label in values:
            stored[label] = [prompt_values(state.cache.layers[layer]).float().cpu() for layer in range(n_layers)]
            stored[f"{label} (uncompressed)"] = [
                shared.cache.layers[layer].values[0].float().cpu().gather(1, positions.clamp(min=0)[..., None].expand(
                    -1, -1, shared.cache.layers[layer].values.shape[-1]))
                for layer, positions in enumerate(kept[label])]
    return kept, shared.logits[0].float().cpu(), stored


def prompt_values(layer) -> torch.Tensor:
    """(kv_heads, kept, head_dim) the values a compressed layer stores for batch row 0's kept prompt positions, in
    their order (a ragged layer's heads zero-padded to the widest)."""
    if hasattr(layer, "prompt_values"):
        return torch.nn.utils.rnn.pad_sequence(layer.prompt_values[0], batch_first=True)
    return layer.values[0]


# Presses the worker hands what our prepared policies computed (QFilters' calibrated filters, DuoAttention's head
# pattern): sent once our half has run; the worker takes every other press first (KvpressRun).
NEEDS_OUR_HALF = ("QFilterPress(", "DuoAttentionPress(")


class KvpressRun:
    """The worker (see benchmarks/_kvpress_worker.py) on the model in `checkpoint`, started at once on the presses
    {label: expression} that need nothing from our half, so that it imports kvpress, loads its model and runs the
    presses that run alone (KVzip's reconstructions, the eager one) while our half runs; `finish` hands it the rest
    and waits for its output. The worker runs every press as one request would: the split changes when it gets
    them, not what it computes. values: the labels whose kept values the worker returns too (merging presses);
    kvzap_weights: {model_type: the safetensors file our KVzap reads}, for KVzapPress (which would load nvidia's);
    query_statistics: the file our ExpectedAttention(statistics="shipped") reads, for ExpectedAttentionStatsPress
    (which would load the Hub's); lukv_curve: the budget curve our LUKV reads, for LUKVPress (which would download
    Llama-3.1-8B-Instruct's); fastkvzip_gates: the gates our FastKVzip reads, for FastKVzipPress (which would load
    the published ones)."""

    def __init__(self, venv: Path, checkpoint: Path, ids: list[int], presses: dict[str, str], values=(),
                 kvzap_weights: dict | None = None, query_statistics: str | None = None, lukv_curve: str | None = None,
                 fastkvzip_gates: str | None = None):
        self.folder = tempfile.TemporaryDirectory()
        folder = Path(self.folder.name)
        request, self.result = folder / "request.json", folder / "kvpress.pt"
        request.write_text(json.dumps({"model": str(checkpoint), "ids": ids, "presses": presses, "attn": "sdpa",
                                       "threads": torch.get_num_threads(), "values": list(values),
                                       "kvzap_weights": kvzap_weights, "query_statistics": query_statistics,
                                       "lukv_curve": lukv_curve, "fastkvzip_gates": fastkvzip_gates,
                                       "more": True}))
        env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
        # files, not pipes: a worker that fills a pipe while we run our half would stall until we read it
        self.stdout, self.stderr = open(folder / "stdout", "w+"), open(folder / "stderr", "w+")
        self.started = time.perf_counter()
        self.process = subprocess.Popen([str(venv / "bin" / "python"), str(WORKER), str(request), str(self.result)],
                                        env=env, stdin=subprocess.PIPE, stdout=self.stdout, stderr=self.stderr,
                                        text=True)

    def finish(self, presses: dict[str, str], q_filters: Path | None = None, duo_pattern: dict | None = None) -> dict:
        """The worker's output for every press, these included; RuntimeError with its last output lines if it fails.
        q_filters: the query filters our QFilters calibrated, for QFilterPress (which would load the authors' from
        the Hub); duo_pattern: our DuoAttention's head pattern (`duo_pattern`), for DuoAttentionPress (which would
        load the published gates). Adds "seconds": the worker's wall time, start to output."""
        try:
            self.process.stdin.write(json.dumps({"presses": presses, "duo_pattern": duo_pattern,
                                                 "q_filters": None if q_filters is None else str(q_filters)}) + "\n")
            self.process.stdin.close()
        except BrokenPipeError:  # the worker has already failed: its output says why
            pass
        code = self.process.wait()
        seconds = time.perf_counter() - self.started
        self.stdout.seek(0)
        self.stderr.seek(0)
        out, log = self.stdout.read(), self.stderr.read()
        if code != 0:
            tail = "\n".join((out + log).splitlines()[-30:])
            raise RuntimeError(f"the kvpress worker failed (exit {code}):\n{tail}")
        return {**torch.load(self.result), "log": log, "seconds": seconds}

    def close(self) -> None:
        """Stop the worker if it still waits (our half failed) and remove its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.stdout.close()
        self.stderr.close()
        self.folder.cleanup()


class KvpressServer:
    """The kvpress venv's worker in timing mode (benchmarks/_kvpress_worker.py --serve): one process, one model
    load, then requests answered one at a time while this process waits (the two never run at once).

        with KvpressServer(venv, checkpoint, threads=2) as server:
            server.ask(cmd="run", press="SnapKVPress(compression_ratio=0.75)", context=..., questions=[...],
                       max_new_tokens=16)  # {"seconds": ..., "answers": [...]}
    """

    def __init__(self, venv: Path, checkpoint: Path, threads: int, no_eos: bool = True):
        env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvpress-worker-", suffix=".log")
        self.process = subprocess.Popen([str(venv / "bin" / "python"), str(WORKER), "--serve"], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.loaded = self.ask(cmd="load", model=str(checkpoint), attn="sdpa", threads=threads, no_eos=no_eos)

    def ask(self, **request) -> dict:
        """Send one request, wait for its reply; RuntimeError with the worker's last log lines on failure."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        reply = json.loads(line) if line else {"error": f"the worker exited ({self.process.poll()})"}
        if "error" in reply:
            self.log.flush()
            self.log.seek(0)
            tail = "\n".join(self.log.read().splitlines()[-30:])
            raise RuntimeError(f"kvpress worker, {request['cmd']}: {reply['error']}\n{tail}")
        return reply

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
        self.log.close()

    def __enter__(self) -> KvpressServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kvpress_style_ids(tokenizer, context: str, questions: list[str]) -> tuple[list[int], list[list[int]]]:
    """The token ids kvpress's pipeline makes of a context and its questions (kvpress/pipeline.py preprocess,
    answer_prefix ""): the chat template around the context with a separator for the user's content, split
    there; the context ids are the template's head and the context, each question's its text and the template's
    tail; all encoded without special tokens."""
    separator = "#" * (len(context) + 10)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                             add_generation_prompt=True, tokenize=False)
    context, suffix = rendered.split(separator)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return encode(context), [encode(question + suffix) for question in questions]


@dataclass
class Agreement:
    """One row's outcome. layers: per layer {jaccard (mean over KV heads), identical, kept_ours, kept_theirs}."""

    row: Row
    policy_label: str
    press: str  # the press as the worker built it (the row's expression, filled in)
    pending: str | None = None
    error: str | None = None
    layers: list = field(default_factory=list)
    value_gap: float | None = None  # rows with `values`: max |our stored value - kvpress's| over every kept entry
    value_shift: float | None = None  # and max |kvpress's stored value - the uncompressed cache's|: what merging moved

    @property
    def jaccard_mean(self) -> float:
        return sum(layer["jaccard"] for layer in self.layers) / len(self.layers)

    @property
    def worst_layer(self) -> int:
        return min(range(len(self.layers)), key=lambda i: self.layers[i]["jaccard"])

    @property
    def identical_layers(self) -> float:
        return sum(layer["identical"] for layer in self.layers) / len(self.layers)

    def kept(self, side: str) -> str:
        """Positions kept per KV head: the mean, with min-max when budgets vary by layer or head."""
        flat = [k for layer in self.layers for k in layer[f"kept_{side}"]]
        mean = sum(flat) / len(flat)
        text = f"{mean:.0f}" if mean == int(mean) else f"{mean:.1f}"
        return text if min(flat) == max(flat) else f"{text} ({min(flat)}-{max(flat)})"

    def summary(self) -> str:
        worst = self.worst_layer
        values = "" if self.value_gap is None else (f", kept values max |gap| {self.value_gap:.2e} (merging moved "
                                                    f"them by up to {self.value_shift:.2e})")
        return (f"{self.row.label}: mean Jaccard {self.jaccard_mean:.4f}, worst layer {worst} "
                f"({self.layers[worst]['jaccard']:.4f}), identical layers {self.identical_layers:.0%}, "
                f"kept per KV head ours {self.kept('ours')}, kvpress {self.kept('theirs')}{values}")


def compare_layers(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> list[dict]:
    """Per layer: the Jaccard overlap |A & B| / |A | B| of the kept position sets, averaged over KV heads.
    ours, theirs: per layer (kv_heads, kept) long positions, -1 padding (ragged heads) ignored."""
    layers = []
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        sa = [{int(p) for p in row if p >= 0} for row in a]
        sb = [{int(p) for p in row if p >= 0} for row in b]
        if len(sa) != len(sb):
            raise ValueError(f"layer {layer}: {len(sa)} KV heads ours, {len(sb)} kvpress's")
        jaccard = [len(x & y) / len(x | y) for x, y in zip(sa, sb)]
        layers.append(dict(jaccard=sum(jaccard) / len(jaccard), identical=sa == sb,
                           kept_ours=[len(x) for x in sa], kept_theirs=[len(y) for y in sb]))
    return layers


@dataclass
class SideBySide:
    """Both sides on one prompt: each row's Agreement, and what they ran on."""

    model: str
    n_tokens: int
    ratio: float
    capacity: int
    logit_gap: float  # max |difference| of the two uncompressed prefills' last logits
    versions: dict
    rows: dict  # label -> Agreement
    kvpress_log: str
    seconds: dict  # {"ours", "kvpress"}: each half's wall time (the worker's includes its model load; the two run at
    # once), "waited": how long the kvpress half ran on after ours


def side_by_side(venv: Path, rows=ROWS, n_tokens: int = N_TOKENS, ratio: float = RATIO) -> SideBySide:
    """Every row on both sides, on the bundled SmolLM2-135M-Instruct (fp32, sdpa, CPU): our policies in one shared
    prefill, every press in one worker run on the same checkpoint."""
    import snapkv_lab
    from snapkv_lab.core.models import bundled_checkpoint
    from snapkv_lab.policies.kvzap import find_weights
    from snapkv_lab.policies.query_filters import find_filters
    from snapkv_lab.policies.query_statistics import find_statistics

    model, tokenizer = snapkv_lab.load_model(device="cpu", dtype="float32", attn_implementation="sdpa")
    lukv_curve(model.config.num_hidden_layers, model.config.num_key_value_heads)  # before the rows are built
    fastkvzip_gates(model)
    ids = prompt_ids(tokenizer, n_tokens)
    capacity = n_kept(len(ids), ratio)
    built = {row.label: our_policy(row, capacity) for row in rows}
    with_values = [row.label for row in rows if row.values]
    later = [row for row in rows if any(press in row.press for press in NEEDS_OUR_HALF)]
    worker = KvpressRun(venv, bundled_checkpoint(), ids,
                        {row.label: row.press.format(ratio=ratio) for row in rows if row not in later}, with_values,
                        kvzap_weights={kind: str(find_weights(model, kind)) for kind in ("linear", "mlp")
                                       if find_weights(model, kind) is not None},
                        query_statistics=None if find_statistics(model) is None else str(find_statistics(model)),
                        lukv_curve=str(LUKV_CURVE), fastkvzip_gates=str(FASTKVZIP_GATES))
    try:
        start = time.perf_counter()
        ours, logits, our_values = run_ours(model, tokenizer, ids,
                                            {label: policy for label, (policy, _) in built.items()}, with_values)
        middle = time.perf_counter()
        duo = next((policy for policy, _ in built.values() if type(policy).__name__ == "DuoAttention"), None)
        pattern = None if duo is None else duo_pattern(duo, len(ids))
        presses = {row.label: row.press.format(ratio=ratio, head_ratio=pattern and pattern["head_ratio"])
                   for row in rows}
        theirs = worker.finish({row.label: presses[row.label] for row in later},
                               q_filters=find_filters(model),  # shipped, or calibrated by run_ours's QFilters
                               duo_pattern=pattern)
    finally:
        worker.close()
    seconds = {"ours": middle - start, "kvpress": theirs["seconds"], "waited": time.perf_counter() - middle}
    agreements = {}
    for row in rows:
        policy, pending = built[row.label]
        other = theirs["presses"][row.label]
        agreement = Agreement(row, policy.label, presses[row.label], pending=pending, error=other["error"])
        if other["error"] is None:
            agreement.layers = compare_layers(ours[row.label], other["kept"])
            if row.values:
                agreement.value_gap = value_gap(ours[row.label], other["kept"], our_values[row.label],
                                                other["values"])
                agreement.value_shift = value_gap(ours[row.label], other["kept"],
                                                  our_values[f"{row.label} (uncompressed)"], other["values"])
        agreements[row.label] = agreement
    gap = float((logits - theirs["last_logits"]).abs().max())
    return SideBySide(model.config.name_or_path, len(ids), ratio, capacity, gap, theirs["versions"], agreements,
                      theirs["log"], seconds)


def value_gap(ours: list[torch.Tensor], theirs: list[torch.Tensor], our_values: list, their_values: list) -> float:
    """max |difference| of the values both sides store at the positions both keep (inf where a side returned none):
    ours, theirs per layer (kv_heads, kept) positions in order; our_values, their_values per layer (kv_heads, kept,
    head_dim), in those positions' order."""
    gap = 0.0
    for a, b, va, vb in zip(ours, theirs, our_values, their_values, strict=True):
        if va is None or vb is None:
            return math.inf
        for head in range(a.shape[0]):
            common, at_a, at_b = numpy.intersect1d(a[head].numpy(), b[head].numpy(), return_indices=True)
            at_a, at_b = at_a[common >= 0], at_b[common >= 0]  # -1 pads a ragged layer's heads: no position
            if len(at_a):
                gap = max(gap, float((va[head][at_a] - vb[head][at_b].float()).abs().max()))
    return gap
