"""The A/B harness and the pressure-test runner (its one-prefill reuse must equal plain `generate`)."""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser

import pandas as pd
import pytest
import torch
from conftest import make_tiny_llama

import snapkv_lab as sl
from snapkv_lab import H2O, FullCache, SnapKV, StreamingLLM, compare, generate
from snapkv_lab.compression.compare import kept_tokens_html
from snapkv_lab.compression.kept import kept_mask
from snapkv_lab.pressure import Context, Query, accuracy_table, run_retrieval

POLICIES = [FullCache(), SnapKV(capacity=40, window_size=8), StreamingLLM(capacity=40, kept_tail=8)]


def tiny():
    return make_tiny_llama(initializer_range=0.3)


def test_compare_table_and_display(byte_tokenizer):
    prompts = ["x" * 30 + "the answer is here " * 4,
               {"prompt": "y" * 70, "question": "what?", "answer": "zz", "name": "agnostic"}]
    table = compare(tiny(), byte_tokenizer, prompts, policies=POLICIES, max_new_tokens=6, progress=False)
    assert len(table) == 6 and list(table.policy[:3]) == ["FullCache", "SnapKV(window_size=8)@40",
                                                           "StreamingLLM(kept_tail=8)@40"]
    assert set(table["mode"]) == {"query-aware", "query-agnostic"}
    assert table.correct.iloc[:3].isna().all() and table.correct.iloc[3:].map(lambda c: c in (True, False)).all()
    first = table[table.prompt == 0]
    assert first.kv_bytes.iloc[0] * 40 == first.kv_bytes.iloc[1] * first.prompt_tokens.iloc[0]  # n -> 40 positions
    assert (first.kv_ratio.iloc[1:] > 1).all() and first.kv_ratio.iloc[0] == 1
    page = table._repr_html_()
    assert "SnapKV(window_size=8)@40" in page and "MiB KV" in page
    assert page.count("[right]") + page.count("[wrong]") == 3  # the prompt with an answer: plain-text verdicts
    assert not re.search("[\u2600-\u27bf\U0001f000-\U0001faff]", page)  # no emoji (they need an emoji font)
    sliced = table[table.policy != "FullCache"]
    assert isinstance(sliced.results, dict)
    view = sliced.kept_view("agnostic", "SnapKV(window_size=8)@40", layer=1, around=(0, 20)).data
    assert view.count("<span title=") == 20


def test_kept_tokens_html_shades_by_fraction(byte_tokenizer):
    kept = [torch.tensor([[[0, 2], [0, 3]]]), torch.tensor([[[0, 2], [1, 2]]])]  # 2 layers, 2 heads, 4 tokens
    mask = kept_mask(kept, 4)
    assert mask.float().mean(dim=(0, 1)).tolist() == [0.75, 0.25, 0.75, 0.25]
    page = kept_tokens_html(byte_tokenizer, torch.tensor([97, 98, 99, 100]), kept, highlight=(1, 2))
    assert "kept by 75%" in page and page.count("class='highlight'") == 1
    assert "kept by 0%" in kept_tokens_html(byte_tokenizer, torch.tensor([97, 98, 99, 100]), kept, layer=0, head=0)
    ragged = [torch.tensor([[[0, 2, -1], [1, 3, 5]]])]  # head 0 keeps 2 (padded with -1), head 1 a generated position 5
    assert kept_mask(ragged, 4)[0].tolist() == [[True, False, True, False], [False, True, False, True]]


class _VisibleText(HTMLParser):
    """Text of an HTML fragment with, for each character, the styles of the elements around it (innermost last)."""

    def __init__(self):
        super().__init__()
        self.stack, self.chars = [], []  # stack: (tag, attrs) of the open elements; chars: (char, stack copy)

    def handle_starttag(self, tag, attrs):
        if tag != "br":
            self.stack.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1][0] == tag, f"unbalanced </{tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.chars += [(c, list(self.stack)) for c in data]


HIDING = re.compile(r"outline|display:\s*none|visibility:\s*hidden|font-size:\s*0|opacity:\s*0|color:\s*transparent"
                    r"|position:\s*absolute")


@pytest.mark.parametrize("around", [None, (10, 33), (32, 50)])  # the span whole, cut at its end, cut at its start
def test_kept_view_shows_every_digit_of_a_highlighted_needle(byte_tokenizer, around):
    """Each digit of the needle is visible text inside one highlight box, and nothing on or inside that box paints
    over characters (an outline per token once covered single digits)."""
    text = "The special magic number is: 9935848. Then the essay goes on."
    value = text.index("9935848")
    ids = torch.tensor(list(text.encode()))
    kept = [torch.tensor([[[0, 1, 2, 30, 31], [0, 5, 29, 33, 34]]])]  # one layer, 2 heads: some digits kept, some not
    page = kept_tokens_html(byte_tokenizer, ids, kept, highlight=(value, value + 7), around=around)
    parser = _VisibleText()
    parser.feed(page)
    assert parser.stack == []  # every element closed
    start, end = around or (0, len(ids))
    shown = range(max(start, value), min(end, value + 7))
    boxed = [(c, stack) for c, stack in parser.chars if any(a.get("class") == "highlight" for _, a in stack)]
    assert "".join(c for c, _ in boxed) == text[shown.start:shown.stop]  # all shown digits, in order, nothing else
    assert all(c.isdigit() for c, _ in boxed) and len(boxed) == len(shown)
    assert page.count("class='highlight'") == 1  # one box around the whole span
    for _, stack in boxed:
        for _, attrs in stack:
            assert not HIDING.search(attrs.get("style", "")), attrs


def test_retrieval_runner_reuse_equals_generate(byte_tokenizer):
    """One prefill per context, many compressed copies: each row must match a fresh `generate`."""
    model = tiny()
    g = torch.Generator().manual_seed(11)
    context = torch.randint(2, 256, (100,), generator=g).tolist()
    question = torch.randint(2, 256, (12,), generator=g).tolist()
    ctx = Context(context, [Query(question, "7", (40, 50), (45, 47))], dict(task="unit", length=112))
    policies = [SnapKV(window_size=8), H2O(kept_tail=8), StreamingLLM(kept_tail=8)]
    table = run_retrieval(model, byte_tokenizer, [ctx], policies=policies, capacities=(40,), max_new_tokens=6,
                          progress=False)
    assert len(table) == 1 + 3 * 2
    full = generate(model, byte_tokenizer, [context + question], max_new_tokens=6)
    assert table.output.iloc[0] == full.text
    for policy in policies:
        sized = dataclasses.replace(policy, capacity=40)
        aware = generate(model, byte_tokenizer, [context + question], policy=sized, max_new_tokens=6)
        agnostic = generate(model, byte_tokenizer, [context], question=question, policy=sized, max_new_tokens=6)
        rows = table[table.policy == policy.scorer_label].set_index("mode")
        assert rows.loc["query-aware", "output"] == aware.text, policy.name
        assert rows.loc["query-agnostic", "output"] == agnostic.text, policy.name
        kept = aware.kept_indices
        span = ((kept[0][0] >= 40) & (kept[0][0] < 50)).sum() + ((kept[1][0] >= 40) & (kept[1][0] < 50)).sum()
        assert rows.loc["query-aware", "fact_kept"] == pytest.approx(float(span) / (2 * 2 * 10))
    assert (table.exact <= table.correct).all()  # a whole-token match is also a substring match
    acc = accuracy_table(table.assign(length=112))
    assert ("query-aware", "FullCache", "full") in acc.index


@pytest.mark.slow
def test_needle_context_places_the_needle(smollm):
    from snapkv_lab.pressure import needle_context

    _, tokenizer = smollm
    for depth in (0.0, 0.5, 1.0):
        ctx = needle_context(tokenizer, 1000, depth, sample=1)
        query = ctx.queries[0]
        assert len(ctx.context_ids) + len(query.question_ids) == 1000
        start, end = query.value_span
        assert tokenizer.decode(ctx.context_ids[start:end]) == query.answer
        assert "special magic number" in tokenizer.decode(ctx.context_ids[query.span[0]:query.span[1]])
        assert len(query.question_ids) >= 32  # SnapKV's window votes with the question alone
    assert isinstance(pd.DataFrame([query.meta]).depth.iloc[0], float)


def test_pressure_figures_draw_from_tables(tmp_path):
    from snapkv_lab.app.figure_sets import load_figure_sets
    from snapkv_lab.core.figure_files import FIGURE_SETS

    rows = [dict(task="needle", length=n, depth=d, sample=0, policy=p, capacity=c, mode=m,
                 correct=(d + (c or 4096) / 4096) > 0.5, value_kept=0.5, fact_kept=0.5)
            for n in (1000, 2000) for d in (0.0, 1.0)
            for p, c, m in [("FullCache", None, "full")] + [(p, c, m) for p in ("SnapKV", "H2O") for c in (256, 512)
                                                               for m in ("query-aware", "query-agnostic")]]
    pd.DataFrame(rows).to_csv(tmp_path / "pressure_needle.csv", index=False)
    pd.DataFrame(rows).assign(task="lines").to_csv(tmp_path / "pressure_lines.csv", index=False)
    written = load_figure_sets()["pressure"].draw(tmp_path, tmp_path)
    assert {p.name for p in written} >= {"pressure_needle_query-aware.png", "pressure_needle_budget.html",
                                         "pressure_lines.png"}
    assert "pressure" in FIGURE_SETS


def test_compare_from_one_prefill_equals_generate(byte_tokenizer):
    """compare reuses one full prefill per prompt: every policy's answer and kept positions equal a fresh
    generate's, query-aware and with several questions on one compressed context."""
    model = tiny()
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(2, 256, (90,), generator=g).tolist()
    questions = [torch.randint(2, 256, (9,), generator=g).tolist() for _ in range(2)]
    # AdaKV: ragged head-wise layers, built under inference mode, then fed the question outside it
    policies = [FullCache(), SnapKV(capacity=40, window_size=8), SnapKV(capacity=40, window_size=16),
                H2O(capacity=0.5, kept_tail=8), sl.AdaKV(capacity=40, policy=sl.SnapKV(window_size=8))]
    table = compare(model, byte_tokenizer, [[prompt], {"prompt": [prompt], "question": questions, "name": "many"}],
                    policies=policies, max_new_tokens=5, progress=False)
    assert len(table) == len(policies) * 3 and table.policy.nunique() == len(policies)
    for policy in policies:
        aware = generate(model, byte_tokenizer, [prompt], policy=policy, max_new_tokens=5)
        many = generate(model, byte_tokenizer, [prompt], question=questions, policy=policy, max_new_tokens=5)
        rows = table[table.policy == policy.label]
        assert rows.answer.tolist() == [aware.text, many[0].text, many[1].text], policy.label
        run = table.results[rows.index[0]]
        assert all(torch.equal(a, b) for a, b in zip(run.kept_indices, aware.kept_indices, strict=True))
        assert rows.kv_bytes.iloc[0] == aware.kv_bytes
    assert table[table.policy == "FullCache"].kv_ratio.iloc[0] == 1


def test_policy_identity_is_its_parameters(byte_tokenizer):
    """Two SnapKV configurations get rows of their own (they once overwrote each other's scores)."""
    model = tiny()
    g = torch.Generator().manual_seed(13)
    ctx = Context(torch.randint(2, 256, (90,), generator=g).tolist(),
                  [Query(torch.randint(2, 256, (8,), generator=g).tolist(), "7", (40, 50), (45, 47))],
                  dict(task="unit", length=98))
    policies = [SnapKV(window_size=8), SnapKV(window_size=8, kernel_size=3)]
    table = run_retrieval(model, byte_tokenizer, [ctx], policies=policies, capacities=(40,), modes=("query-aware",),
                          max_new_tokens=4, progress=False)
    assert sorted(table.policy) == ["FullCache", "SnapKV(kernel_size=3, window_size=8)", "SnapKV(window_size=8)"]
    for policy in policies:
        run = generate(model, byte_tokenizer, [ctx.context_ids + ctx.queries[0].question_ids], max_new_tokens=4,
                       policy=dataclasses.replace(policy, capacity=40))
        assert table[table.policy == policy.scorer_label].output.item() == run.text
    with pytest.raises(ValueError, match="share a label"):
        compare(model, byte_tokenizer, [[ctx.context_ids]], policies=[SnapKV(capacity=40), SnapKV(capacity=40)],
                progress=False)


def test_window_longer_than_the_question_spans_the_context(byte_tokenizer):
    """Query-aware scores of a question chunk shorter than the window: the window takes the context's last
    queries too, as one prefill of context and question does (it once raised 'must hold the whole window')."""
    model = tiny()
    g = torch.Generator().manual_seed(14)
    ctx = Context(torch.randint(2, 256, (90,), generator=g).tolist(),
                  [Query(torch.randint(2, 256, (6,), generator=g).tolist(), "7", (40, 50), (45, 47))],
                  dict(task="unit", length=96))
    policies = [SnapKV(window_size=16), H2O(kept_tail=16)]
    table = run_retrieval(model, byte_tokenizer, [ctx], policies=policies, capacities=(40,), modes=("query-aware",),
                          max_new_tokens=5, progress=False)
    for policy in policies:
        one_chunk = generate(model, byte_tokenizer, [ctx.context_ids + ctx.queries[0].question_ids], max_new_tokens=5,
                             policy=dataclasses.replace(policy, capacity=40))
        row = table[table.policy == policy.scorer_label]
        assert row.output.item() == one_chunk.text, policy.label
        assert row.fact_kept.item() == pytest.approx(sum(float(((k[0] >= 40) & (k[0] < 50)).sum())
                                                         for k in one_chunk.kept_indices)
                                                     / (2 * 2 * 10))


def test_ruler_table_and_figure_from_a_run(tmp_path, byte_tokenizer):
    """A RULER-style table from a real (tiny) run: one row per query x policy x mode, both grades, the tasks the
    full cache fails marked, and the figure drawn from it."""
    from snapkv_lab.app.figure_sets import load_figure_sets
    from snapkv_lab.pressure import ruler_table

    model = tiny()
    g = torch.Generator().manual_seed(15)
    contexts = []
    for task, answer in (("multikey", "7"), ("multivalue", ["7", "8"])):
        contexts.append(Context(torch.randint(2, 256, (80,), generator=g).tolist(),
                                [Query(torch.randint(2, 256, (8,), generator=g).tolist(), answer, (40, 50), (45, 47))],
                                dict(task=task, value_kind="number", needles=2, length=88, sample=0)))
    table = run_retrieval(model, byte_tokenizer, contexts, policies=[SnapKV(window_size=8)], capacities=(40,),
                          max_new_tokens=4, progress=False)
    assert len(table) == 2 * 3 and {"correct", "exact"} <= set(table.columns)
    summary = ruler_table(table)
    assert list(summary.index) == [("multikey", "number"), ("multivalue", "number")]
    full = table[table["mode"] == "full"].set_index("task").correct
    assert summary.full_cache_fails.tolist() == [not full["multikey"], not full["multivalue"]]
    table.to_csv(tmp_path / "pressure_ruler.csv", index=False)
    written = load_figure_sets()["pressure"].draw(tmp_path, tmp_path)
    assert {p.name for p in written} == {"pressure_ruler.png", "pressure_ruler.html"}


def test_wilson_intervals():
    from snapkv_lab.pressure import accuracy_intervals, wilson

    low, high = wilson(0, 5)
    assert (low == pytest.approx(0, abs=1e-12)
            and high == pytest.approx(3.8415 / 5 / (1 + 3.8415 / 5), abs=1e-3))  # 0.434
    low, high = wilson(5, 5)
    assert high == pytest.approx(1) and low == pytest.approx(1 - 0.4345, abs=1e-3)
    low, high = wilson(7, 15)
    assert low < 7 / 15 < high and (low, high) == pytest.approx((0.248, 0.699), abs=2e-3)
    table = pd.DataFrame(dict(policy=["A"] * 4 + ["B"] * 2, mode="m", correct=[1, 1, 0, 1, 0, 0],
                              exact=[1, 0, 0, 1, 0, 0]))
    intervals = accuracy_intervals(table).set_index("policy")
    assert intervals.loc["A", ["asked", "correct", "exact"]].tolist() == [4, 3, 2]
    assert intervals.loc["B", "correct_high"] == pytest.approx(wilson(0, 2)[1])


def test_extra_scoring_pass_is_shared_by_budgets_and_selection_settings(byte_tokenizer, monkeypatch):
    """KVzip's reconstruction pass runs once per prefill, whatever the budgets and pooling of its variants."""
    from snapkv_lab.compression import SharedPrefill

    model = make_tiny_llama("sdpa")
    ids = torch.randint(2, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    policies = [sl.KVzip(capacity=24, kept_tail=4), sl.KVzip(capacity=40, kept_tail=4),
                sl.KVzip(capacity=40, kept_tail=4, pooling="max", kernel_size=5)]
    calls = []
    original = sl.KVzip.prompt_scores
    monkeypatch.setattr(sl.KVzip, "prompt_scores", lambda self, *a: calls.append(self) or original(self, *a))
    shared = SharedPrefill.run(model, byte_tokenizer, ids, policies)
    states = [shared.state(p) for p in policies]
    assert len(calls) == 1
    fresh = SharedPrefill.run(model, byte_tokenizer, ids, policies[2:])  # its own pass, nothing shared
    assert all(torch.equal(a, b) for a, b in zip(fresh.state(policies[2]).kept_indices.values(),
                                                 states[2].kept_indices.values()))
    assert not torch.equal(states[1].kept_indices[0], states[2].kept_indices[0])  # pooling changed the selection


def test_a_shared_prefill_holds_only_the_last_queries_it_votes_with(byte_tokenizer):
    """The recorder keeps each layer's last `voters` queries for the policies that vote after the prefill; a view
    of the prompt's query tensor would keep all n of them alive in every layer (found on a GPU: CAKE and
    LookaheadQCache peaked 8 GB above the full cache at 32k tokens of an 8B shape)."""
    model = make_tiny_llama()
    ids = torch.randint(3, 200, (1, 96), generator=torch.Generator().manual_seed(0))
    shared = sl.compression.shared.SharedPrefill.run(model, byte_tokenizer, ids, [sl.CAKE(capacity=48)])
    assert shared.recorder.recent, "CAKE votes with the prompt's last queries: the recorder should keep them"
    for query, slots in shared.recorder.recent.values():
        assert query.shape[2] == shared.recorder.voters == 32
        assert query.untyped_storage().nbytes() == query.nbytes
        assert slots.untyped_storage().nbytes() == slots.nbytes
