"""ExpectedAttention against a plain reference written from its authors' code (NVIDIA kvpress 0.5.5,
presses/expected_attention_press.py and utils.py), on the tiny Llama, Cohere (interleaved RoPE), Gemma 3 (per-layer-type
RoPE, q_norm, its own scaling), StableLM (partial rotary), SmolLM3 (layers without RoPE) and SmolLM2 (slow); the same
scores however the prompt is chunked; the voters' token positions while decoding."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama
from families import FAMILIES, TINY, make, sliding_layers
from reference import kv_heads, top_with_tail
from transformers import DeepseekV3Config, DynamicCache, LlamaConfig, SmolLM3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
from transformers.models.llama.modeling_llama import LlamaAttention

import snapkv_lab as C
from snapkv_lab.compression.engine import kept_from_scores
from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.core.attention import AttentionSettings
from snapkv_lab.core.hooks import intercept_attention
from snapkv_lab.core.rope import LayerRope
from snapkv_lab.policies.base import AttentionCall

N, CAPACITY = 96, 40
N_FUTURE, N_SINK = 512, 4  # kvpress ExpectedAttentionPress defaults (expected_attention_press.py:56-57)


def prompt(n=N, batch=1, seed=1):
    return torch.randint(2, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


# ----- the reference, from kvpress's code ---------------------------------------------------------------

def rope_matrix(position: int, head_dim: int, theta: float, rotary_dims: int, pairing: str) -> torch.Tensor:
    """(head_dim, head_dim) float64: the family's RoPE at `position` as a matrix R (post = R pre), written from the
    modeling code. The first rotary_dims dims are rotated in pairs: "half" pairs i with i + rotary_dims / 2 (Llama's
    rotate_half), "interleaved" pairs 2i with 2i + 1 (Cohere's rotate_half); pair i turns by position *
    theta ** (-2i / rotary_dims). The other dims pass unchanged (partial rotary: GPT-NeoX, Phi, StableLM)."""
    half = rotary_dims // 2
    angles = position * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dims)
    first, second = (torch.arange(half), torch.arange(half) + half) if pairing == "half" else \
        (torch.arange(0, rotary_dims, 2), torch.arange(1, rotary_dims, 2))
    R = torch.eye(head_dim, dtype=torch.float64)
    R[first, first], R[second, second] = angles.cos(), angles.cos()
    R[first, second], R[second, first] = -angles.sin(), angles.sin()
    return R


def attention_inputs(model, ids):
    """A prefill of ids: per layer the attention module's input hidden states (batch, n, hidden) and the cache."""
    hidden = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: hidden.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            cache = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
    finally:
        for hook in hooks:
            hook.remove()
    return hidden, cache


def expected_attention_reference(model, ids, layers, *, theta, rotary_dims=None, pairing="half", scaling=None,
                                 rope=True) -> dict[int, torch.Tensor]:
    """ExpectedAttentionPress.score (kvpress 0.5.5, presses/expected_attention_press.py) over a prefill of ids:
    pre-RoPE queries from the attention module's input hidden states, the first N_SINK rows dropped (:70); R = the
    mean of the family's RoPE matrices over positions n .. n + N_FUTURE - 1 (:110-120; kvpress builds Llama's
    half-split R for every model; here the family's, `pairing`, `rotary_dims`, or the identity where the layer has no
    RoPE); then `reference_scores` with the layer's cached keys and values. s = 1/sqrt(d) as kvpress (:149), or
    `scaling`. Returns {layer: (batch, kv_heads, n) float64} for `layers`."""
    hidden, cache = attention_inputs(model, ids)
    n, scores = ids.shape[1], {}
    d = model.model.layers[0].self_attn.head_dim
    R = (mean_rope(range(n, n + N_FUTURE), d, theta, rotary_dims or d, pairing) if rope
         else torch.eye(d, dtype=torch.float64))
    for layer in layers:
        attn = model.model.layers[layer].self_attn
        scores[layer] = reference_scores(prerope_queries(attn, hidden[layer][:, N_SINK:]), cache.layers[layer].keys,
                                         cache.layers[layer].values, R,
                                         1 / math.sqrt(d) if scaling is None else scaling)
    return scores


def mean_rope(positions, head_dim, theta, rotary_dims, pairing="half") -> torch.Tensor:
    """(head_dim, head_dim) float64 mean of the RoPE matrices at `positions` (kvpress :119-120)."""
    return torch.stack([rope_matrix(t, head_dim, theta, rotary_dims, pairing) for t in positions]).mean(0)


def prerope_queries(attn, hidden: torch.Tensor) -> torch.Tensor:
    """(batch, heads, rows, d) float64 queries before RoPE from the attention module's input hidden states (batch,
    rows, hidden): q_proj, then the per-head q_norm where the module has one (kvpress utils.py:43-51,
    get_prerope_query_states)."""
    heads, d = attn.config.num_attention_heads, attn.head_dim
    with torch.no_grad():
        q = attn.q_proj(hidden).view(hidden.shape[0], hidden.shape[1], heads, d).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
    return q.double()


def reference_scores(q, keys, values, R, s, statistics=None) -> torch.Tensor:
    """kvpress's closed form (expected_attention_press.py) from pre-RoPE queries q (batch, heads, rows, d), post-RoPE
    keys and values (batch, kv_heads, n, d), the mean rotation R (d, d), the scaling s: the queries' mean and biased
    covariance (:73-80), or the precomputed `statistics` (mean (heads, d), cov (heads, d, d)) as
    ExpectedAttentionStatsPress reads them (expected_attention_with_stats.py:60-67); mu' = R mu, Sigma' = R Sigma R^T
    (:121-123); logits mu'.k s + k^T Sigma' k s^2 / 2 over the keys after the N_SINK sinks (:138, :149-151); softmax
    (:152); mean over each KV head's query heads (:155-156); times ||v|| (:159-160); the sinks +inf (:163: max + 1
    there). Returns (batch, kv_heads, n) float64."""
    batch, heads, rows, _ = q.shape
    mu = q.mean(dim=2, keepdim=True)
    cov = (q - mu).transpose(2, 3) @ (q - mu) / rows  # (batch, heads, d, d)
    if statistics is not None:
        mu, cov = statistics[0].double()[None, :, None], statistics[1].double()[None]
    mu, cov = mu @ R.T, R @ cov @ R.T
    keys, values = keys.double(), values.double()
    n, kv = keys.shape[2], keys.shape[1]
    k = keys[:, :, N_SINK:].repeat_interleave(heads // kv, dim=1)  # (batch, heads, n - sinks, d)
    logits = (k @ mu.transpose(2, 3))[..., 0] * s + ((k @ cov) * k).sum(-1) * s * s / 2
    scores = logits.softmax(-1).view(batch, kv, -1, n - N_SINK).mean(2) * values[:, :, N_SINK:].norm(dim=-1)
    return torch.nn.functional.pad(scores, (N_SINK, 0), value=math.inf)


def recorded_scores(model, ids, policy) -> dict[int, torch.Tensor]:
    """{layer: (batch, kv_heads, n)} the policy's scores recorded over one prefill, averaged over each KV head's
    query heads (the GQA mean `keep` ranks by)."""
    shared = SharedPrefill.run(model, ByteTokenizer(), ids, [policy])
    scores = shared.recorder.scores[policy.scorer_label]
    kv = kv_heads(model.config)
    return {layer: s.view(s.shape[0], kv, -1, s.shape[-1]).mean(2) for layer, s in scores.items()}


def assert_matches_reference(model, ids, layers, rtol=1e-4, **reference):
    """Scores equal the reference's within rtol (float32 vs float64, un-rotated vs q_proj queries), and the compressor
    keeps the reference's top CAPACITY (the sinks among them), but where scores tie within that tolerance. Measured
    over these tests: 1e-5 relative at most."""
    policy = C.ExpectedAttention(capacity=CAPACITY)
    mine = recorded_scores(model, ids, policy)
    kept = C.generate(model, ByteTokenizer(), ids, policy=policy, max_new_tokens=1).kept_indices
    for layer, ref in expected_attention_reference(model, ids, layers, **reference).items():
        torch.testing.assert_close(mine[layer].double(), ref, rtol=rtol, atol=0, msg=lambda m: f"layer {layer}: {m}")
        ref_kept = top_with_tail(ref, CAPACITY, ids.shape[1])
        assert bool((kept[layer][..., :N_SINK] == torch.arange(N_SINK)).all())
        if not torch.equal(kept[layer], ref_kept):  # a swap at the boundary only between scores tied within rtol
            def picked(k):
                return ref.gather(-1, k).sort(-1).values[..., :-N_SINK]  # the sinks (inf) sort last

            torch.testing.assert_close(picked(kept[layer]), picked(ref_kept), rtol=rtol, atol=0)


# ----- against the reference ----------------------------------------------------------------------------

def test_defaults_are_kvpress():
    """kvpress 0.5.5 ExpectedAttentionPress (expected_attention_press.py:55-60) keeps no window."""
    policy = C.ExpectedAttention()
    assert (policy.n_future_positions, policy.n_sink, policy.use_covariance, policy.use_vnorm, policy.epsilon,
            policy.kept_tail) == (512, 4, True, True, 0.0, 0)
    assert policy.label == "ExpectedAttention@1024"


def test_matches_reference_llama():
    model = make_tiny_llama(initializer_range=0.3)
    assert_matches_reference(model, prompt(batch=2, seed=7), range(2), theta=model.config.rope_parameters["rope_theta"])


def test_matches_reference_cohere_interleaved_rope():
    model = FAMILIES["cohere-gqa"]()
    assert_matches_reference(model, prompt(seed=2), range(3), theta=model.config.rope_parameters["rope_theta"],
                             pairing="interleaved")


def test_matches_reference_stablelm_partial_rotary():
    model = FAMILIES["stablelm-gqa"]()
    rope = model.config.rope_parameters
    rotary_dims = int(model.model.layers[0].self_attn.head_dim * rope["partial_rotary_factor"])
    assert rotary_dims == 4  # of 16 dims
    assert_matches_reference(model, prompt(seed=3), range(3), theta=rope["rope_theta"], rotary_dims=rotary_dims)


def test_matches_reference_gemma3_full_layer():
    """Gemma 3's full-attention layer (1; the sliding ones are never compressed) rotates with its own base, 1e6, not
    the sliding layers' 1e4; its queries pass q_norm; its attention scales by query_pre_attn_scalar ** -0.5 (here 32,
    head_dim 16): our documented choice where kvpress divides by sqrt(head_dim), shown to matter below."""
    model = FAMILIES["gemma3-sliding"]()
    assert sliding_layers(model.config) == {0, 2}
    rope = model.config.rope_parameters["full_attention"]
    assert (rope["rope_type"] == "default"
            and rope["rope_theta"] != model.config.rope_parameters["sliding_attention"]["rope_theta"])
    scaling = model.model.layers[1].self_attn.scaling
    assert scaling == 32 ** -0.5
    assert_matches_reference(model, prompt(seed=4), [1], theta=rope["rope_theta"], scaling=scaling)
    with pytest.raises(AssertionError):  # kvpress's 1 / sqrt(head_dim) scores differently
        assert_matches_reference(model, prompt(seed=4), [1], theta=rope["rope_theta"])


def test_matches_reference_smollm3_layers_without_rope():
    """SmolLM3 skips RoPE on the layers with no_rope_layers[i] = 0: their queries are used as they are, R = I."""
    model = ROPE_MODELS["smollm3-nope"]()
    theta = model.config.rope_parameters["rope_theta"]
    assert_matches_reference(model, prompt(seed=5), [0, 2], theta=theta)
    assert_matches_reference(model, prompt(seed=5), [1], theta=theta, rope=False)


# Besides tests/families.py: YaRN scales cos and sin by its attention_scaling (1 + 0.1 ln 4 here), which the
# un-rotation must divide out; SmolLM3 leaves layer 1 unrotated.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
ROPE_MODELS = {**{name: make_family for name, make_family in FAMILIES.items() if not name.startswith("gpt2")},
               "llama-yarn": lambda: make(LlamaConfig, rope_parameters=YARN, num_key_value_heads=2),
               "smollm3-nope": lambda: make(SmolLM3Config, no_rope_layers=[1, 0, 1], num_key_value_heads=2)}


@pytest.mark.parametrize("family", sorted(ROPE_MODELS))
def test_unrotation_recovers_what_the_family_rotated(family):
    """For every RoPE family of tests/families.py: un-rotating the post-RoPE queries the attention function receives
    gives back what the family's apply_rotary_pos_emb was handed during the forward, to float32 rounding (its q: the
    rotated part of a partial rotary), and the mean rotation equals the average of the family's rotation matrices
    position by position (kvpress's average of R_t, :119-120), which `mean_rotation` forms from the mean cos and sin."""
    model = ROPE_MODELS[family]()
    modeling = sys.modules[type(model).__module__]
    original, handed, seen = modeling.apply_rotary_pos_emb, [], {}

    def recording(q, k, cos, sin, *args, **kwargs):
        handed.append(q)
        return original(q, k, cos, sin, *args, **kwargs)

    def grab(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (module, query[0])

    modeling.apply_rotary_pos_emb = recording
    try:
        with torch.no_grad(), intercept_attention(model, grab):
            model(prompt(64, seed=6), use_cache=False)
    finally:
        modeling.apply_rotary_pos_emb = original
    rotated = [module for module, _ in seen.values() if getattr(module, "use_rope", True)]
    assert len(handed) == len(rotated) and len(seen) == model.config.num_hidden_layers
    handed = dict(zip(rotated, handed, strict=True))
    for module, query in seen.values():
        rope = LayerRope.of(module, query.shape[-1])
        unrotated = rope.unrotate(query.double(), torch.arange(64))
        before = handed.get(module, query[None])  # a layer without RoPE: its queries as they are
        rotary_dims = before.shape[-1]
        scale = float(before.abs().max())  # float32 rounding of the model's rotation: 1.3e-7 of it at most, measured
        torch.testing.assert_close(unrotated[..., :rotary_dims], before[0].double(), rtol=0, atol=1e-6 * scale)
        assert torch.equal(unrotated[..., rotary_dims:], query[..., rotary_dims:].double())  # never rotated
        future = torch.arange(100, 612)
        eye = torch.eye(query.shape[-1], dtype=torch.float64)
        if module not in handed:
            assert torch.equal(rope.mean_rotation(future), eye)
            continue
        cos, sin = rope.cos_sin(future)
        explicit = torch.stack([rope._rotate(eye[None], c.expand(len(eye), -1), s_.expand(len(eye), -1))[0].T
                                for c, s_ in zip(cos[:, None], sin[:, None])]).mean(0)
        torch.testing.assert_close(rope.mean_rotation(future), explicit, rtol=0, atol=1e-12)


def test_covariance_and_value_norms_change_the_selection():
    """Else the reference checks could pass with either term missing."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = prompt(seed=8)
    def run(**kw):
        return C.generate(model, ByteTokenizer(), ids, policy=C.ExpectedAttention(capacity=CAPACITY, **kw),
                          max_new_tokens=1).kept_indices

    base = run()
    assert any(not torch.equal(a, b) for a, b in zip(base, run(use_covariance=False)))
    assert any(not torch.equal(a, b) for a, b in zip(base, run(use_vnorm=False)))


def test_refuses_what_it_cannot_score():
    model = FAMILIES["gpt2"]()
    with pytest.raises(NotImplementedError, match="GPT2Attention"):
        C.generate(model, ByteTokenizer(), prompt(64), policy=C.ExpectedAttention(capacity=CAPACITY), max_new_tokens=1)
    with pytest.raises(ValueError, match="keeps its n_sink = 4 sinks"):  # kvpress would evict some of them
        C.generate(make_tiny_llama(), ByteTokenizer(), prompt(8), policy=C.ExpectedAttention(capacity=4),
                   max_new_tokens=1)


def test_refuses_ropes_it_cannot_reproduce():
    """DeepSeek V3 rotates the tail of its MLA heads, interleaved or not; dynamic NTK RoPE changes its frequencies
    with the lengths the model has seen: an un-rotation would silently be wrong."""
    deepseek = DeepseekV3Config(**{**TINY, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16,
                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    with pytest.raises(NotImplementedError, match="DeepseekV3Attention.*apply_rotary_pos_emb_interleave"):
        LayerRope.of(DeepseekV3Attention(deepseek, layer_idx=0), 16)
    dynamic = LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(NotImplementedError, match="LlamaAttention: dynamic NTK"):
        LayerRope.of(LlamaAttention(dynamic, layer_idx=0), 16)


@pytest.mark.slow
def test_matches_reference_smollm(smollm):
    from snapkv_lab.tasks.corpus import haystack_ids

    model, tokenizer = smollm
    ids = torch.tensor([haystack_ids(tokenizer, 600, start=3)])
    policy = C.ExpectedAttention(capacity=200)
    mine = recorded_scores(model, ids, policy)
    kept = C.generate(model, tokenizer, ids, policy=policy, max_new_tokens=1).kept_indices
    theta = model.config.rope_parameters["rope_theta"]
    for layer, ref in expected_attention_reference(model, ids, range(model.config.num_hidden_layers),
                                                   theta=theta).items():
        torch.testing.assert_close(mine[layer].double(), ref, rtol=1e-3, atol=0, msg=lambda m: f"layer {layer}: {m}")
        ref_kept = top_with_tail(ref, 200, ids.shape[1])
        shared = torch.isin(kept[layer], ref_kept).float().mean()
        assert shared > 0.99, f"layer {layer}: {shared:.3f}"


# ----- chunk invariance ---------------------------------------------------------------------------------

def captured_calls(model, ids):
    """One prefill's attention calls, per layer: the (query, key, value) tensors and settings the hook saw."""
    calls = {}

    def grab(module, query, key, value, attention_mask, **kwargs):
        calls[module.layer_idx] = (module, query, key, value, AttentionSettings.of_call(module, kwargs))

    with torch.no_grad(), intercept_attention(model, grab):
        model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    return calls


@pytest.mark.parametrize("cuts", [[70], [3, 40, 70, 95]])
def test_chunked_statistics_equal_one_call(cuts):
    """The same tensors scored in one call, or as successive chunks sharing a carry (the first chunk of 3 rows lies
    among the sinks): the same scores, bit for bit (the running sums are float64: their rounding, which depends on
    the chunking, lies far below the float32 scores' last bit)."""
    model = make_tiny_llama(initializer_range=0.3)
    policy = C.ExpectedAttention()
    for layer, (module, query, key, value, settings) in captured_calls(model, prompt()).items():
        whole = policy.score(AttentionCall(query[0], key[0], value[0], torch.arange(N), settings, module, layer, 2))
        carry = {}
        for start, end in zip([0, *cuts], [*cuts, N]):
            call = AttentionCall(query[0, :, start:end], key[0, :, :end], value[0, :, :end], torch.arange(start, end),
                                 settings, module, layer, 2, carry=carry)
            chunked = policy.score(call)
        assert torch.equal(chunked, whole), layer
        last_only = policy.score(AttentionCall(query[0, :, cuts[-1]:], key[0], value[0], torch.arange(cuts[-1], N),
                                               settings, module, layer, 2))
        assert not torch.allclose(last_only, whole, rtol=1e-2)  # the carry matters


def kept_of(shared, policy):
    n, layers = shared.n_tokens, shared.model.config.num_hidden_layers
    return kept_from_scores(policy, shared.recorder.scores[policy.scorer_label], n, kv_heads(shared.model.config),
                            layers)


def test_one_prefill_equals_context_then_question():
    """One prefill of context + question, the context then the question (SharedPrefill.extend), the context in three
    chunks, and any of these recorded beside SnapKV(window_size=64) (which votes across the chunks): the same kept
    positions. Layer 0, whose queries and keys are the same bits however the prompt was fed, scores bitwise alike;
    in layer 1 the model's chunked forward rounds its queries and keys differently from one forward (by up to 3e-6),
    which moves the scores by up to 2e-5 relative (measured over 3 prompts), and no two scores lie that close at the
    boundary. Without the carried statistics they differ by more than 1e-2 (the next test)."""
    model = make_tiny_llama(initializer_range=0.3)
    ids = prompt(160, seed=11)
    policy, snapkv = C.ExpectedAttention(capacity=48), C.SnapKV(capacity=96, window_size=64)
    one = SharedPrefill.run(model, ByteTokenizer(), ids, [policy])
    runs = {
        "context then question": SharedPrefill.run(model, ByteTokenizer(), ids[:, :130], [policy]).extend(ids[:, 130:]),
        "three chunks": SharedPrefill.run(model, ByteTokenizer(), ids[:, :50], [policy]).extend(ids[:, 50:130])
        .extend(ids[:, 130:]),
        "beside SnapKV": SharedPrefill.run(model, ByteTokenizer(), ids[:, :130], [snapkv, policy]).extend(ids[:, 130:]),
        "one prefill beside SnapKV": SharedPrefill.run(model, ByteTokenizer(), ids, [snapkv, policy]),
    }
    expected = kept_of(one, policy)
    for name, run in runs.items():
        for layer, kept in kept_of(run, policy).items():
            assert torch.equal(kept, expected[layer]), f"{name}, layer {layer}"
            scores, expected_scores = (run.recorder.scores[policy.scorer_label][layer],
                                       one.recorder.scores[policy.scorer_label][layer])
            if layer == 0:
                assert torch.equal(scores, expected_scores), name
            torch.testing.assert_close(scores, expected_scores, rtol=1e-4, atol=0)
    beside = runs["one prefill beside SnapKV"].recorder.scores[policy.scorer_label]
    assert all(torch.equal(beside[layer], one.recorder.scores[policy.scorer_label][layer]) for layer in beside)


# ----- while decoding -----------------------------------------------------------------------------------

def test_decoding_eviction_takes_the_voters_at_their_token_positions():
    """Inside DecodingEviction, each eviction scores the cache with the queries generated since the last one: the
    reference from those tokens' input hidden states (q_proj: no rotation to undo, so a query un-rotated by its cache
    slot instead of its token position, which differ once the prompt was compressed, would not match) and R from the
    token after the last one on. (kvpress's DecodingPress would start R at its buffer's length and drop the buffer's
    first n_sink rows; here, our documented choice, every voter counts, all lying past the sinks' positions.)"""
    model = make_tiny_llama(initializer_range=0.3)
    ids = prompt(48, seed=8)
    hidden, evictions = [], []
    attn = model.model.layers[1].self_attn
    hook = attn.register_forward_pre_hook(lambda module, args, kwargs: hidden.append(kwargs["hidden_states"][0]),
                                          with_kwargs=True)
    original = C.ExpectedAttention.score

    def spy(self, call):
        scores = original(self, call)
        if call.layer == 1:
            evictions.append((call, scores))
        return scores

    C.ExpectedAttention.score = spy
    try:
        C.generate(model, ByteTokenizer(), ids, policy=C.DecodingEviction(policy=C.ExpectedAttention(), capacity=20,
                                                                          kept_tail=4, interval=8), max_new_tokens=26)
    finally:
        C.ExpectedAttention.score = original
        hook.remove()
    rows = torch.cat(hidden)  # (tokens, hidden): row p is the layer's input at token position p
    decoding = [(call, scores) for call, scores in evictions if call.positions[0] >= 48]
    assert len(decoding) >= 2
    for call, scores in decoding:
        positions = call.positions.tolist()
        assert positions != call.slots.tolist() and len(positions) == 8
        q = prerope_queries(attn, rows[positions][None])
        R = mean_rope(range(positions[-1] + 1, positions[-1] + 1 + N_FUTURE), 16,
                      model.config.rope_parameters["rope_theta"], 16)
        ref = reference_scores(q, call.key[None], call.value[None], R, 0.25)[0]
        torch.testing.assert_close(scores.view(2, 2, -1).mean(1).double(), ref, rtol=1e-4, atol=0)


def test_precomputed_statistics_follow_kvpress_recipe_and_scoring(tmp_path):
    """ExpectedAttention(statistics=...) is ExpectedAttentionStatsPress: the statistics by kvpress's recipe
    (expected_attention_with_stats.py:185-237: pre-RoPE queries of every text, its first N_SINK tokens left out, the
    mean and the covariance with N - 1 over all of them), then the press's closed form with them in place of the
    prompt's own (reference_scores), from the stored file read back here."""
    from safetensors.torch import load_file

    from snapkv_lab.policies import query_statistics

    model = make_tiny_llama(initializer_range=0.3)
    texts = ["".join(chr(97 + (7 * i + 3 * j) % 26) for j in range(40 + 9 * i)) for i in range(3)]
    statistics = query_statistics.collect(model, ByteTokenizer(), texts)
    queries = {layer: [] for layer in range(model.config.num_hidden_layers)}
    for text in texts:
        hidden, _ = attention_inputs(model, torch.tensor([list(text.encode())]))
        for layer in queries:
            queries[layer].append(prerope_queries(model.model.layers[layer].self_attn, hidden[layer][:, N_SINK:])[0])
    for layer, rows in queries.items():
        q = torch.cat(rows, dim=1)  # (heads, N, d)
        mu = q.mean(1, keepdim=True)
        torch.testing.assert_close(statistics[layer][0], mu[:, 0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(statistics[layer][1], (q - mu).transpose(1, 2) @ (q - mu) / (q.shape[1] - 1),
                                   rtol=1e-5, atol=1e-6)
    path = tmp_path / "statistics.safetensors"
    query_statistics.save(path, statistics, {"texts": "test"})
    stored = load_file(str(path))
    ids = prompt()
    policy = C.ExpectedAttention(capacity=CAPACITY, statistics=str(path))
    assert policy.label == f"ExpectedAttention(statistics={str(path)!r})@{CAPACITY}"
    mine = recorded_scores(model, ids, policy)
    hidden, cache = attention_inputs(model, ids)
    d = model.model.layers[0].self_attn.head_dim
    R = mean_rope(range(N, N + N_FUTURE), d, model.config.rope_parameters["rope_theta"], d)
    for layer in queries:
        ref = reference_scores(prerope_queries(model.model.layers[layer].self_attn, hidden[layer]),
                               cache.layers[layer].keys, cache.layers[layer].values, R, 1 / math.sqrt(d),
                               statistics=(stored["mean"][layer], stored["cov"][layer]))
        torch.testing.assert_close(mine[layer].double(), ref, rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match="statistics"):
        C.ExpectedAttention(statistics="nowhere.safetensors")


def test_shipped_statistics_are_whole_covariances():
    """Every shipped statistics file (policies/weights/expected_attention/) holds, for each layer it names, a mean and
    a covariance per query head that a covariance can be: symmetric, positive semi-definite up to bfloat16 rounding;
    its record names kvpress's recipe."""
    import json

    from safetensors import safe_open

    from snapkv_lab.policies import query_statistics

    files = sorted(query_statistics.SHIPPED.glob("*.safetensors"))
    assert any(path.name.startswith("SmolLM2-135M-Instruct-") for path in files)
    for path in files:
        with safe_open(str(path), "pt") as file:
            record = json.loads(file.metadata()["record"])
        assert record["n_sink"] == N_SINK and record["texts"].startswith("100 x 1000 characters")
        for layer, (mean, cov) in query_statistics.load(path).items():
            assert mean.shape == cov.shape[:2] and cov.shape[-1] == cov.shape[-2] == mean.shape[-1], (path, layer)
            torch.testing.assert_close(cov, cov.mT)
            eigenvalues = torch.linalg.eigvalsh(cov)
            assert bool((eigenvalues >= -1e-2 * eigenvalues.amax(-1, keepdim=True)).all()), (path, layer)
