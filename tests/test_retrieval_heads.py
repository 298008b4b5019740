"""retrieval_heads on the bundled SmolLM2, against the score counted plainly from transformers' eager maps."""

from __future__ import annotations

import pytest
from reference import eager_maps

from snapkv_lab import capture
from snapkv_lab.policies.retrieval_heads import retrieval_heads
from snapkv_lab.pressure import needle_context

LENGTHS, DEPTHS, NEW = (500,), (0.3, 0.7), 12


def plain_counts(model, tokenizer):
    """{(layer, head): [copy steps, hits]} summed over the found needle prompts, one row and one head at a time."""
    counts, prompts = {}, 0
    for depth in DEPTHS:
        context = needle_context(tokenizer, LENGTHS[0], depth, 0)
        query = context.queries[0]
        trace = capture(model, tokenizer, context.context_ids + query.question_ids, max_new_tokens=NEW, progress=False)
        if query.answer not in trace.generated_text:
            continue
        prompts += 1
        ids = trace.token_ids.cpu()
        start, end = query.span
        maps = eager_maps(model, ids)
        for layer, attn in enumerate(maps):
            for head in range(attn.shape[0]):
                steps = hits = 0
                for row in range(trace.prompt_len - 1, trace.n_tokens - 1):
                    emitted = int(ids[row + 1])
                    if emitted not in ids[start:end].tolist():
                        continue
                    steps += 1
                    top = int(attn[head, row, : row + 1].argmax())
                    hits += start <= top < end and int(ids[top]) == emitted
                total = counts.setdefault((layer, head), [0, 0])
                total[0], total[1] = total[0] + steps, total[1] + hits
    return counts, prompts


@pytest.mark.slow
def test_pooled_scores_equal_a_plain_count_over_eager_maps_and_are_cached(smollm, tmp_path, monkeypatch):
    model, tokenizer = smollm
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    table = retrieval_heads(model, tokenizer, lengths=LENGTHS, depths=DEPTHS, max_new_tokens=NEW, progress=False)
    expected, prompts = plain_counts(model, tokenizer)
    assert prompts >= 1 and (table.prompts == prompts).all()  # SmolLM2 finds a needle at 500 tokens
    assert len(table) == model.config.num_hidden_layers * model.config.num_attention_heads
    for row in table.itertuples():
        assert [row.copy_steps, row.retrieval_hits] == expected[row.layer, row.head], (row.layer, row.head)
    assert table.retrieval_score.max() > 0.5  # some head copies the needle: a retrieval head
    assert (table.retrieval_score.dropna().between(0, 1)).all()
    import snapkv_lab.retrieval_heads as module

    monkeypatch.setattr(module, "capture", lambda *a, **k: pytest.fail("the cached table was recomputed"))
    again = retrieval_heads(model, tokenizer, lengths=LENGTHS, depths=DEPTHS, max_new_tokens=NEW, progress=False)
    assert again.equals(table)
    assert list((tmp_path / "retrieval_heads").glob("SmolLM2-135M-Instruct-*.csv"))


@pytest.mark.slow
def test_the_shipped_table_is_read_for_the_bundled_model_and_holds_a_prompt_measured_again(smollm, tmp_path,
                                                                                           monkeypatch):
    """SmolLM2's table at the defaults ships in the package (scripts/ship_calibrations.py): an empty cache folder
    reads it, no capture run, nothing written; it pools its prompts as the measurement does (hits over copy steps, 10
    prompts of 1000 and 2000 tokens); one of them measured again here counts no more copy steps or hits at any head
    than the table holds, and some hits (a table of another model, or of other settings, would not hold them)."""
    from snapkv_lab.policies import retrieval_heads as module

    model, tokenizer = smollm
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))
    with monkeypatch.context() as patch:
        patch.setattr(module, "capture", lambda *a, **k: pytest.fail("the shipped table was not read"))
        shipped = retrieval_heads(model, tokenizer, progress=False)
    assert not (tmp_path / "retrieval_heads").exists()
    assert len(shipped) == model.config.num_hidden_layers * model.config.num_attention_heads
    assert (shipped.prompts == 10).all()  # SmolLM2 finds every default needle
    scored = shipped.copy_steps > 0
    assert (shipped.retrieval_score[scored] == shipped.retrieval_hits[scored] / shipped.copy_steps[scored]).all()
    again = retrieval_heads(model, tokenizer, lengths=(1000,), depths=(0.5,), cache=False, progress=False)
    both = again.merge(shipped, on=["layer", "head"], suffixes=("_again", ""))
    assert len(both) == len(shipped) and again.retrieval_hits.sum() > 0
    assert (both.copy_steps_again <= both.copy_steps).all() and (both.retrieval_hits_again <= both.retrieval_hits).all()
