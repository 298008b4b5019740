"""TOVA, KNorm, ChunkKV and CriticalKV: kept positions vs each paper's rule written plainly from transformers'
eager attention maps and its own cache (post-RoPE keys, values), on the tiny random Llama and on SmolLM2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_twin, make_tiny_llama
from reference import assert_same_selection

import snapkv_lab as C
from snapkv_lab.compression.shared import SharedPrefill
from snapkv_lab.core.attention import AttentionSettings
from snapkv_lab.core.hooks import intercept_attention
from snapkv_lab.policies.base import AttentionCall

WINDOW, CAPACITY, N = 8, 40, 96


def tiny(attn="sdpa"):
    # A larger init than the default 0.02 gives peaked attention, so scores are not near-uniform ties.
    return make_tiny_llama(attn, initializer_range=0.3)


# ----------------------------------------------------------------------------------------------- references

def eager_run(model, ids):
    """What transformers computes over ids (batch, n): per layer attention maps (batch, heads, n, n), post-RoPE
    keys and values (batch, kv_heads, n, head_dim), and the output projection weights (hidden, heads * head_dim)."""
    twin = eager_twin(model)
    with torch.no_grad():
        out = twin(ids, output_attentions=True, use_cache=True)
    layers = out.past_key_values.layers
    return dict(attentions=out.attentions, keys=[layer.keys for layer in layers],
                values=[layer.values for layer in layers],
                o_proj=[block.self_attn.o_proj.weight.detach() for block in twin.model.layers])


def group_mean(scores, kv_heads):
    """(batch, heads, n) -> (batch, kv_heads, n): mean over the query heads sharing each KV head."""
    return scores.reshape(scores.shape[0], kv_heads, -1, scores.shape[-1]).mean(dim=2)


def snapkv_scores(attn, window, kv_heads, kernel=7):
    """SnapKV's ranking (batch, kv_heads, prefix): window votes, max-pooled, averaged over each GQA group."""
    prefix = attn.shape[-1] - window
    votes = attn[:, :, -window:, :prefix].sum(dim=2)  # (batch, heads, prefix)
    return group_mean(F.max_pool1d(votes, kernel, stride=1, padding=kernel // 2), kv_heads)


def top_plus_window(scores, k, n):
    """Top-k prefix positions of scores (batch, kv_heads, prefix), sorted, then the window up to n."""
    top = scores.topk(k, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, torch.arange(scores.shape[-1], n).expand(*top.shape[:2], -1)], dim=-1)


def ref_tova(run, capacity, kv_heads):
    """TOVA as its official code (schwartz-lab-NLP/TOVA, src/tova_cache.py, TOVACache.reduce, lines 41-43): the last
    query's attention row averaged over ALL heads, `torch.mean(attn_weights[:, :, -1, :], dim=1)`, and the top
    `cache_size` keys of that one row, the last key competing like any other; every KV head keeps the same set."""
    kept, scores = [], []
    for attn in run["attentions"]:
        score = attn[:, :, -1, :].mean(dim=1)  # (batch, n): one row per layer
        top = score.topk(capacity, dim=-1).indices.sort(dim=-1).values
        kept.append(top[:, None].expand(-1, kv_heads, -1))
        scores.append(score[:, None].expand(-1, kv_heads, -1))
    return kept, scores


def ref_knorm(run, capacity, window):
    """KNorm (the paper: keep the keys of lowest L2 norm; kvpress 0.5.5 presses/knorm_press.py line 46): minus the L2
    norm of each post-RoPE key in the model's own cache, per KV head; `window` last positions kept besides."""
    kept, scores = [], []
    for keys in run["keys"]:  # (batch, kv_heads, n, d)
        n = keys.shape[2]
        score = -torch.linalg.vector_norm(keys[:, :, : n - window], dim=-1)  # (batch, kv_heads, prefix)
        kept.append(top_plus_window(score, capacity - window, n))
        scores.append(score)
    return kept, scores


def ref_chunkkv_official(run, capacity, window, chunk, kv_heads):
    """ChunkKV over SnapKV as kvpress's ChunkKVPress, contributed by the paper's first author (kvpress 0.5.5,
    presses/chunkkv_press.py, compress, lines 77-125): the whole prompt cut into chunks from position 0, the inner
    scores (SnapKV's, the window at max + 1: snapkv_press.py line 103) summed over the KV heads, a chunk's score the
    mean over its tokens, the best max(1, int(n_chunks * capacity / n)) chunks kept whole, the same for every head."""
    kept = []
    for attn in run["attentions"]:
        n = attn.shape[-1]
        score = snapkv_scores(attn, window, kv_heads)  # (batch, kv_heads, prefix)
        score = F.pad(score, (0, window), value=float(score.max()) + 1).sum(dim=1)  # (batch, n)
        chunks = [list(range(start, min(start + chunk, n))) for start in range(0, n, chunk)]
        n_kept = max(1, int(len(chunks) * (capacity / n)))
        layer = []
        for b in range(score.shape[0]):
            means = torch.tensor([score[b, c].mean().item() for c in chunks])
            chosen = sorted(p for i in means.topk(n_kept).indices.tolist() for p in chunks[i])
            layer.append(torch.tensor(chosen).expand(kv_heads, -1))
        kept.append(torch.stack(layer))
    return kept


def ref_chunkkv(run, capacity, window, chunk, kv_heads):
    """ChunkKV(per_head=True, exact_budget=True), our variant, written plainly: chunks [0, c), [c, 2c), ... of the
    prefix ranked by their mean SnapKV score per KV head; whole chunks taken best first, the last one cut to what the
    budget has left, then the window."""
    kept = []
    for attn in run["attentions"]:
        n = attn.shape[-1]
        prefix = n - window
        score = snapkv_scores(attn, window, kv_heads)  # (batch, kv_heads, prefix)
        chunks = [list(range(start, min(start + chunk, prefix))) for start in range(0, prefix, chunk)]
        layer = torch.empty(*score.shape[:2], capacity, dtype=torch.long)
        for b in range(score.shape[0]):
            for h in range(kv_heads):
                means = [score[b, h, c].mean().item() for c in chunks]
                chosen = []
                for i in sorted(range(len(chunks)), key=lambda i: -means[i]):
                    chosen += chunks[i][: capacity - window - len(chosen)]
                layer[b, h] = torch.tensor(sorted(chosen) + list(range(prefix, n)))
        kept.append(layer)
    return kept


def ref_criticalkv(run, capacity, window, kv_heads, ratio=0.5, eps=1e-4, kernel=7):
    """CriticalKV over SnapKV as its authors' code (FFY0/AdaKV-in-NVIDIA-kvpress, branch criticalkv; the same in
    kvpress 0.5.5, presses/criticalkv_press.py, CriticalKVPress.score, lines 75-98, over SnapKVPress.score, whose
    window gets the maximum score + 1, snapkv_press.py line 103): over the whole prompt, stage 1 = the
    int(ratio * capacity) best scores (the window among them), stage 2 = the rest of the capacity by
    (score + eps) * ||v W_o^h||_1, the L1 norm averaged over each KV head's query heads; SnapKV's votes averaged over
    the window (snapkv_press.py line 95), the scale epsilon is set on."""
    kept = []
    for attn, values, weight in zip(run["attentions"], run["values"], run["o_proj"]):
        heads, d = attn.shape[1], values.shape[-1]
        score = snapkv_scores(attn, window, kv_heads, kernel) / window  # (batch, kv_heads, prefix)
        score = F.pad(score, (0, window), value=float(score.max()) + 1)  # the window: max + 1
        norms = torch.stack([  # (batch, heads, n): head h's value through its slice of W_o, (hidden, d)
            (values[:, h // (heads // kv_heads)] @ weight[:, h * d:(h + 1) * d].T).abs().sum(dim=-1)
            for h in range(heads)], dim=1)
        first = score.topk(int(ratio * capacity), dim=-1).indices  # stage 1
        weighted = ((score + eps) * group_mean(norms, kv_heads)).scatter(-1, first, torch.finfo(score.dtype).max)
        kept.append(weighted.topk(capacity, dim=-1).indices.sort(dim=-1).values)  # stage 2
    return kept


def assert_equal_kept(kept, ref_kept):
    for layer, (mine, ref) in enumerate(zip(kept, ref_kept, strict=True)):
        assert mine.shape == ref.shape, layer
        agree = (mine == ref).float().mean()
        assert torch.equal(mine, ref), f"layer {layer}: {agree:.1%} of kept positions agree"


# ------------------------------------------------------------------------------------- tiny random Llama

@pytest.fixture(scope="module")
def tiny_run():
    model = tiny()
    ids = torch.randint(2, 256, (2, N), generator=torch.Generator().manual_seed(21))
    return model, ids, eager_run(model, ids)


def test_tova_matches_last_query_attention(tiny_run, byte_tokenizer):
    model, ids, run = tiny_run
    result = C.generate(model, byte_tokenizer, ids, policy=C.TOVA(capacity=CAPACITY), max_new_tokens=1)
    ref_kept, ref_scores = ref_tova(run, CAPACITY, 2)
    assert_same_selection(result.kept_indices, ref_kept, ref_scores, 0)
    grouped = C.generate(model, byte_tokenizer, ids, policy=C.TOVA(capacity=CAPACITY, per_layer=False),
                         max_new_tokens=1)
    assert any(not torch.equal(k[:, 0], k[:, 1]) for k in grouped.kept_indices)  # the variant: one set per KV head


def test_tova_evicts_at_every_step_as_its_code(tiny_run, byte_tokenizer):
    """Decoding: TOVACache.reduce runs after every forward (src/tova_cache.py): the cache holds `cache_size` after each
    step, chosen by the newest query's head-averaged attention over what is cached. Reference: the eager twin over the
    full cache with everything not held masked out, one token at a time."""
    model, ids, _ = tiny_run
    ids = ids[:1]
    steps = 6
    result = C.generate(model, byte_tokenizer, ids, policy=C.TOVA(capacity=CAPACITY), max_new_tokens=steps)
    twin = eager_twin(model)
    with torch.no_grad():
        out = twin(ids, output_attentions=True, use_cache=True)
    held = [attn[0, :, -1].mean(0).topk(CAPACITY).indices.sort().values.tolist() for attn in out.attentions]
    cache, logits, tokens = out.past_key_values, out.logits[0, -1], []
    for step in range(steps):
        token = logits.argmax()
        tokens.append(int(token))
        if step == steps - 1:
            break
        position = N + step
        mask = torch.full((1, len(held), 1, position + 1), float("-inf"))
        for layer, positions in enumerate(held):
            mask[0, layer, 0, positions + [position]] = 0
        masks = {layer: mask[:, layer:layer + 1] for layer in range(len(held))}
        with torch.no_grad(), intercept_attention(
                twin, None, attend=lambda f, m, q, k, v, a, **kw: f(m, q, k, v, masks[m.layer_idx], **kw)):
            out = twin(token.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[position]]),
                       output_attentions=True)
        for layer, attn in enumerate(out.attentions):  # (1, heads, 1, position + 1): the new query over the held keys
            row = attn[0, :, 0].mean(0)
            candidates = held[layer] + [position]
            held[layer] = sorted(sorted(candidates, key=lambda p: -float(row[p]))[:CAPACITY])
        logits = out.logits[0, -1]
    assert result.token_ids[0].tolist() == tokens
    for layer, positions in enumerate(held):
        assert result.kept_indices[layer][0, 0].tolist() == positions, layer


def test_knorm_matches_key_norms(tiny_run, byte_tokenizer):
    model, ids, run = tiny_run
    result = C.generate(model, byte_tokenizer, ids, policy=C.KNorm(capacity=CAPACITY, kept_tail=WINDOW),
                        max_new_tokens=2)
    ref_kept, ref_scores = ref_knorm(run, CAPACITY, WINDOW)
    assert_same_selection(result.kept_indices, ref_kept, ref_scores, WINDOW)


@pytest.mark.parametrize("chunk", [10, 7])  # 96 tokens: 9 chunks of 10 and one of 6; 13 of 7 and one of 5
def test_chunkkv_matches_its_official_code(chunk, tiny_run, byte_tokenizer):
    model, ids, run = tiny_run
    policy = C.ChunkKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW), chunk_size=chunk)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    assert_equal_kept(result.kept_indices, ref_chunkkv_official(run, CAPACITY, WINDOW, chunk, 2))
    for kept in result.kept_indices:  # one set of whole chunks for every head, the window's among them
        assert torch.equal(kept[:, 0], kept[:, 1]) and set(range(N - WINDOW, N)) <= set(kept[0, 0].tolist())
        assert kept.shape[-1] <= CAPACITY


@pytest.mark.parametrize("chunk", [10, 7])  # 88-token prefix: 8 chunks of 10 and one of 8; 12 of 7 and one of 4
def test_chunkkv_exact_budget_matches_chunk_ranking(chunk, tiny_run, byte_tokenizer):
    model, ids, run = tiny_run
    policy = C.ChunkKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW), chunk_size=chunk, per_head=True,
                       exact_budget=True)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    assert_equal_kept(result.kept_indices, ref_chunkkv(run, CAPACITY, WINDOW, chunk, 2))
    for kept in result.kept_indices:  # whole chunks, but for at most one cut chunk per head
        prefix = kept[..., :-WINDOW]
        counts = torch.stack([torch.bincount(row // chunk, minlength=N // chunk + 1)
                              for row in prefix.reshape(-1, prefix.shape[-1])])
        sizes = torch.bincount(torch.arange(N - WINDOW) // chunk, minlength=N // chunk + 1)
        assert (((counts > 0) & (counts < sizes)).sum(dim=-1) <= 1).all()


@pytest.mark.parametrize("ratio", [0.5, 0.25])  # stage 1 holds the window (8 of 40): see CriticalKV
def test_criticalkv_matches_two_stage_selection(ratio, tiny_run, byte_tokenizer):
    model, ids, run = tiny_run
    policy = C.CriticalKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW), first_stage_ratio=ratio)
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=2)
    assert_equal_kept(result.kept_indices, ref_criticalkv(run, CAPACITY, WINDOW, 2, ratio=ratio))
    snapkv = C.generate(model, byte_tokenizer, ids, policy=C.SnapKV(capacity=CAPACITY, window_size=WINDOW),
                        max_new_tokens=2)
    assert any(not torch.equal(a, b) for a, b in zip(result.kept_indices, snapkv.kept_indices))  # the norms matter


VARIANTS = [C.TOVA(capacity=CAPACITY), C.KNorm(capacity=CAPACITY, kept_tail=WINDOW),
            C.ChunkKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW), exact_budget=True),
            C.ChunkKV(policy=C.H2O(), capacity=CAPACITY, kept_tail=WINDOW, exact_budget=True),
            C.CriticalKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW)),
            C.CriticalKV(policy=C.H2O(), capacity=CAPACITY, kept_tail=WINDOW),
            C.CriticalKV(policy=C.KNorm(), capacity=CAPACITY, kept_tail=WINDOW),
            C.CriticalKV(capacity=CAPACITY, policy=C.SnapKV(window_size=WINDOW), per_query_head=True),
            C.ChunkKV(capacity=0.5, policy=C.SnapKV(window_size=WINDOW), exact_budget=True)]


@pytest.mark.parametrize("policy", VARIANTS, ids=lambda p: p.label)
def test_cache_length_equals_budget(policy, byte_tokenizer):
    model = tiny()
    ids = torch.randint(2, 256, (1, 90), generator=torch.Generator().manual_seed(22))
    result = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=3)
    budget, rows = policy.budget(90), 4 if policy.per_query_head else 2
    assert result.cache_lengths == [budget] * 2
    for kept in result.kept_indices:
        assert kept.shape == (1, rows, budget)
        assert all(row.unique().numel() == budget for row in kept.reshape(-1, budget))  # sorted, no position twice
        assert torch.equal(kept, kept.sort(dim=-1).values)
        tail = policy.tail(budget)
        assert torch.equal(kept[0, 0, budget - tail:], torch.arange(90 - tail, 90))


@pytest.mark.parametrize("policy", VARIANTS[:-1], ids=lambda p: p.label)
def test_context_then_question_scores_equal_one_prefill(policy, byte_tokenizer):
    """Scores recorded over a context then a question (the A/B engine's query-aware mode) must select what one
    prefill of both selects: accumulating inner scores (H2O) add up, CriticalKV's value norms count once."""
    model = tiny()
    ids = torch.randint(2, 256, (1, 100), generator=torch.Generator().manual_seed(23))
    state = SharedPrefill.run(model, byte_tokenizer, ids[:, :60], [policy]).extend(ids[:, 60:]).state(policy)
    whole = C.generate(model, byte_tokenizer, ids, policy=policy, max_new_tokens=1)
    for layer, kept in enumerate(whole.kept_indices):
        assert torch.equal(state.kept_indices[layer], kept), layer


def test_wrappers_propagate_budget_and_name_settings():
    chunk = C.ChunkKV(capacity=40, policy=C.SnapKV(window_size=8), chunk_size=5, per_head=True)
    assert (chunk.policy.capacity, chunk.policy.window_size) == (40, 8)
    assert chunk.label == "ChunkKV(policy=SnapKV(window_size=8), chunk_size=5, per_head=True)@40"
    assert (C.CriticalKV(policy=C.SnapKV(kernel_size=5), capacity=64).label
            == "CriticalKV(policy=SnapKV(kernel_size=5))@64")
    assert C.CriticalKV(policy=C.H2O()).scorer_label != C.CriticalKV().scorer_label
    assert C.ChunkKV(capacity=64).scorer_label == C.ChunkKV(capacity=128).scorer_label  # budgets share scores
    assert C.TOVA(capacity=2).kept_tail == 0 and C.KNorm(capacity=2).kept_tail == 0  # as their papers: no kept tail
    with pytest.raises(ValueError, match="inner policy"):
        C.ChunkKV(pooling="max")
    with pytest.raises(ValueError, match="chunk_size"):
        C.ChunkKV(chunk_size=0)
    with pytest.raises(TypeError, match="wraps"):
        C.CriticalKV(policy=C.FullCache())
    # Wrappers compose, and the label spells the composition; kept_tail=None leaves the inner policy's own tail.
    critical_ada = C.CriticalKV(policy=C.AdaKV(policy=C.SnapKV(pooling="avg")), capacity=64)
    assert critical_ada.label == "CriticalKV(policy=AdaKV(policy=SnapKV(pooling='avg')))@64"
    assert critical_ada.policy.policy.capacity == 64 and critical_ada.tail(64) == 32  # SnapKV's observation window
    ada_knorm = C.AdaKV(policy=C.KNorm())
    assert (ada_knorm.label, ada_knorm.tail(1024)) == ("AdaKV(policy=KNorm)@1024", 0)
    assert C.AdaKV(policy=C.KNorm(), kept_tail=4).label == "AdaKV(policy=KNorm, kept_tail=4)@1024"
    assert C.AdaKV(policy=C.SnapKV(window_size=8)).label == "AdaKV(policy=SnapKV(window_size=8))@1024"


def test_criticalkv_refuses_attention_without_o_proj():
    g = torch.Generator().manual_seed(0)
    call = AttentionCall(query=torch.randn(4, 8, 16, generator=g), key=torch.randn(2, 8, 16, generator=g),
                         value=torch.randn(2, 8, 16, generator=g), slots=torch.arange(8),
                         attention=AttentionSettings(scaling=0.25), module=torch.nn.Module(), layer=0, n_layers=1)
    with pytest.raises(TypeError, match="o_proj"):
        C.CriticalKV(capacity=6, policy=C.SnapKV(window_size=2)).score(call)


# ------------------------------------------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smollm_run(smollm):
    from snapkv_lab.tasks.corpus import haystack_ids

    model, tokenizer = smollm
    ids = torch.tensor([haystack_ids(tokenizer, 600, start=3)])
    return model, tokenizer, ids, eager_run(model, ids)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TOVA", "KNorm", "ChunkKV", "CriticalKV"])
def test_kept_indices_match_reference_smollm(name, smollm_run):
    model, tokenizer, ids, run = smollm_run
    kv_heads, capacity = model.config.num_key_value_heads, 256
    policy = C.POLICIES[name](capacity=capacity)  # the defaults: TOVA and KNorm no window; ChunkKV whole chunks of 10
    if name == "CriticalKV":  # max pooling makes plateaus of equal scores where stage 1 ends on this prompt: any
        policy = C.CriticalKV(policy=C.SnapKV(kernel_size=1), capacity=capacity)  # tie-break is right; test without
    result = C.generate(model, tokenizer, ids, policy=policy, max_new_tokens=1)
    if name == "TOVA":
        assert_same_selection(result.kept_indices, *ref_tova(run, capacity, kv_heads), 0)
    elif name == "KNorm":
        assert_same_selection(result.kept_indices, *ref_knorm(run, capacity, 0), 0)
    elif name == "ChunkKV":
        assert_equal_kept(result.kept_indices, ref_chunkkv_official(run, capacity, 32, 10, kv_heads))
    else:
        assert_equal_kept(result.kept_indices, ref_criticalkv(run, capacity, 32, kv_heads, kernel=1))
    expected = 60 * capacity // 600 * 10 if name == "ChunkKV" else capacity  # whole chunks: 25 of 60
    assert result.cache_lengths == [expected] * model.config.num_hidden_layers
