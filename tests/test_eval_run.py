"""`evaluate` and its pieces: budgets, cells, framing and truncation, one example's rows, resuming, the summaries."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ByteTokenizer, make_tiny_llama

from snapkv_lab.evaluation import (
    Example,
    Question,
    budgets,
    encode_example,
    eval_cells,
    evaluate,
    explain,
    gap_to_full,
    leaderboard,
    paired_difference,
    read_results,
    registry,
    run_example,
    task_scores,
)
from snapkv_lab.policies import SnapKV, StreamingLLM, policy_config


@dataclass
class ToyBenchmark:
    """Two tasks of byte-tokenised examples: a "code" to repeat from the middle of a filler context."""

    name: str = "toy"
    tasks: tuple = ("repeat", "twice")
    default_tasks: tuple = ("repeat",)

    def specs(self, task, *, limit=None, lengths=(), seed=0, source=None):
        return [dict(dataset=self.name, task=task, index=i, seed=seed) for i in range(limit or 3)]

    def example(self, spec, tokenizer):
        code = f"{spec['index'] + 7 * spec['seed']:03d}"
        filler = "the sky is blue. " * 12
        questions = (Question(" What is the code?", (code,), answer_prefix=" The code is"),)
        if spec["task"] == "twice":
            questions += (Question(" Say the code again.", (code,)),)
        context = f"Read. {filler}The code is {code}. {filler}"
        start = context.index(code)
        return Example(self.name, spec["task"], str(spec["index"]), context, questions, "string_match_all",
                       max_new_tokens=5, meta=dict(length=None, needle_spans=[(start, start + 3)]))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.DATASETS, "toy", ToyBenchmark())
    return registry.DATASETS["toy"]


@pytest.fixture
def tiny_as_default(monkeypatch):
    """The tiny model stands in for the default bundled one, under its name: reused rows match by it."""
    from snapkv_lab.core.models import model_name

    def default_model(name):
        model = make_tiny_llama()
        model.config.name_or_path = model_name(None)
        return model, ByteTokenizer()

    monkeypatch.setattr("snapkv_lab.sweep.executors._load_model", default_model)


class ChatByteTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template: "<u>content</u><a>" around one user turn."""

    chat_template = "toy"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role'][0]}>{m['content']}</{m['role'][0]}>" for m in messages) + "<a>"


def test_ratios_are_kvpress_compression_ratios_and_bad_budgets_are_refused():
    assert budgets([0.25, 0.75]) == [{"ratio": 0.25}, {"ratio": 0.75}]
    assert budgets(capacities=[64]) == [{"capacity": 64}]
    with pytest.raises(ValueError, match="not both"):
        budgets([0.5], [64])
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        budgets([1.0])
    with pytest.raises(ValueError, match="positive token counts"):
        budgets(capacities=[0])


def test_cells_one_per_example_and_bad_options_refused(toy):
    cells = eval_cells(None, ["toy"], tasks=["repeat", "twice"], policies=["SnapKV(window_size=8)"], ratios=[0.5],
                       limit=2)
    assert [(c.config["example"]["task"], c.config["example"]["index"]) for c in cells] == \
        [("repeat", 0), ("repeat", 1), ("twice", 0), ("twice", 1)]
    assert cells[0].config["policies"] == [policy_config(SnapKV(window_size=8))]
    assert len(eval_cells(None, ["toy"], ratios=[0.5])) == 3  # the default task, the benchmark's default count
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        eval_cells(None, ["nope"], ratios=[0.5])
    with pytest.raises(ValueError, match=r"unknown tasks \['niah'\].*toy: repeat, twice"):
        eval_cells(None, ["toy"], tasks=["niah"], ratios=[0.5])
    with pytest.raises(ValueError, match="full cache runs in every example"):
        eval_cells(None, ["toy"], policies=["FullCache"], ratios=[0.5])
    with pytest.raises(ValueError, match="modes must be among"):
        eval_cells(None, ["toy"], ratios=[0.5], modes=["sideways"])
    with pytest.raises(ValueError, match="share a label"):  # their rows could not be told apart
        eval_cells(None, ["toy"], policies=["SnapKV", "SnapKV(kernel_size=7)"], ratios=[0.5])
    with pytest.raises(ValueError, match="window_size"):  # a window at or above a budget in tokens, before any run
        eval_cells(None, ["toy"], policies=["SnapKV"], capacities=[16])


def test_all_stands_for_every_registered_compressor(toy):
    from snapkv_lab.policies import POLICY_NAMES

    cells = eval_cells(None, ["toy"], policies=["all"], ratios=[0.5], limit=1)
    names = [config["name"] for config in cells[0].config["policies"]]
    # every registered compressor, in the registry's order, and the full cache only where asked for
    assert names == [name for name in POLICY_NAMES if name != "FullCache"] and len(names) == len(POLICY_NAMES) - 1
    with pytest.raises(ValueError, match="share a label"):  # "all" already holds SnapKV at its defaults
        eval_cells(None, ["toy"], policies=["all", "SnapKV"], ratios=[0.5])
    with pytest.raises(ValueError, match="full cache runs in every example"):  # the baseline is never a policy
        eval_cells(None, ["toy"], policies=["FullCache"], ratios=[0.5])


def test_plain_framing_keeps_the_official_text_and_cuts_the_context_from_its_middle(toy):
    tokenizer = ByteTokenizer()
    example = toy.example(dict(task="repeat", index=4, seed=0), tokenizer)
    whole = encode_example(tokenizer, example)
    assert bytes(whole.context_ids).decode() == example.context  # no BOS for this tokenizer, no labels added
    assert bytes(whole.questions[0]).decode() == " What is the code? The code is"
    assert whole.truncated == 0 and whole.framing == "plain"
    cut = encode_example(tokenizer, example, max_context=200)
    room = 200 - len(whole.questions[0])
    assert len(cut.context_ids) == room and cut.truncated == len(whole.context_ids) - room
    assert cut.context_ids == whole.context_ids[:room // 2] + whole.context_ids[-(room - room // 2):]
    with pytest.raises(ValueError, match="no room for the context"):
        encode_example(tokenizer, example, max_context=len(whole.questions[0]) + 1)


def test_chat_framing_wraps_context_and_question_in_one_turn_unless_the_task_is_sent_raw(toy):
    tokenizer = ChatByteTokenizer()
    example = toy.example(dict(task="repeat", index=1, seed=0), tokenizer)
    chat = encode_example(tokenizer, example)
    assert chat.framing == "chat"
    assert bytes(chat.context_ids).decode() == "<u>" + example.context
    assert bytes(chat.questions[0]).decode() == " What is the code?</u><a> The code is"  # the prefix after the turn
    raw = encode_example(tokenizer, Example(**{**example.__dict__, "chat": False}))
    assert raw.framing == "plain" and bytes(raw.context_ids).decode() == example.context
    assert encode_example(tokenizer, example, framing="plain").framing == "plain"


def _config(policies, ratios=(0.5,), modes=("query-aware", "query-agnostic"), task="repeat", index=0):
    return dict(model=None, policies=[policy_config(p) for p in policies], budgets=budgets(list(ratios)),
                modes=list(modes), max_context=None, framing=None,
                example=dict(dataset="toy", task=task, index=index, seed=0))


def test_one_example_gives_the_full_cache_and_every_policy_budget_and_mode_per_question(toy):
    model, tokenizer = make_tiny_llama(), ByteTokenizer()
    table = run_example(model, tokenizer, _config([SnapKV(window_size=8), StreamingLLM(kept_tail=8)],
                                                  ratios=(0.25, 0.75), task="twice"))
    assert len(table) == 2 * (1 + 2 * 2 * 2)  # questions x (full + policies x ratios x modes)
    full = table[table["mode"] == "full"]
    assert list(full.policy) == ["FullCache", "FullCache"] and (full.ratio == 0).all()
    assert (full.kept_tokens == full.prompt_tokens).all()
    compressed = table[table["mode"] != "full"]
    assert set(compressed.ratio) == {0.25, 0.75} and compressed.capacity.isna().all()
    agnostic = compressed[compressed["mode"] == "query-agnostic"]
    context = int(table.context_tokens.iloc[0])
    # kvpress's ratio: the share of the compressed prompt removed (the context alone, query-agnostic)
    for ratio, part in agnostic.groupby("ratio"):
        assert (part.kept_tokens == int((1 - ratio) * context)).all(), (ratio, part.kept_tokens.tolist())
    aware = compressed[compressed["mode"] == "query-aware"]
    assert (aware.kept_tokens < aware.prompt_tokens).all()
    assert table.score.between(0, 1).all()
    assert json.loads(table.references.iloc[0]) == ["000"]
    # the score is the metric of the prediction: string_match_all of the code in the answer
    assert (table.score == [float("000" in p.lower()) for p in table.prediction]).all()


def test_an_examples_answers_are_counted_by_a_bar_of_their_own(toy, monkeypatch):
    totals = []

    def counting_bar(iterable, *, total, **options):
        totals.append(total)
        return iterable

    monkeypatch.setattr("snapkv_lab.evaluation.run.progress_bar", counting_bar)
    table = run_example(make_tiny_llama(), ByteTokenizer(), _config([SnapKV(window_size=8)], ratios=(0.25, 0.75),
                                                                    task="twice"))
    assert totals == [len(table)] == [2 * (1 + 2 * 2)]


def test_a_rerun_resumes_without_redoing_a_cell(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("snapkv_lab.sweep.executors._load_model", lambda name: (make_tiny_llama(), ByteTokenizer()))
    options = dict(datasets=["toy"], policies=["SnapKV(window_size=8)"], ratios=[0.5], modes=["query-agnostic"],
                   limit=2, data_dir=tmp_path)
    first = evaluate(**options)
    assert "2 to run" in capsys.readouterr().err
    again = evaluate(**options)
    err = capsys.readouterr().err
    assert "2 already in" in err and "0 to run" in err
    pd.testing.assert_frame_equal(first, again)
    written = read_results(tmp_path / "eval_toy.csv")
    assert (written.example.tolist() == first.example.tolist()
            and written.prediction.tolist() == first.prediction.tolist())
    assert len(written) == 2 * 2 and set(written["mode"]) == {"full", "query-agnostic"}


def test_explain_reruns_a_row_exactly_and_measures_its_coverage(toy):
    model, tokenizer = make_tiny_llama(), ByteTokenizer()
    table = run_example(model, tokenizer, _config([SnapKV(window_size=8)], ratios=(0.5,)))
    for _, row in table.iterrows():
        why = explain(model, tokenizer, row)
        assert why.run.text == row.prediction  # the very run the table scored
        assert why.prompt_ids.shape[1] == row.prompt_tokens
        assert set(why.coverage.layer) == {0, 1} and why.coverage.coverage.dropna().between(0, 1 + 1e-5).all()
        example = toy.example(json.loads(row.spec), tokenizer)
        start = example.context.index("000")
        assert why.spans == [(start, start + 3)]  # no frame head for this tokenizer: characters are tokens
        summary = why.summary()
        assert summary.loc[row.policy, "answer"] == row.prediction
        if row.policy != "FullCache":
            assert summary.loc["FullCache", "answer"] == why.trace.generated_text.strip()
            kept = why.kept_indices
            expected = sum(((k[0] >= start) & (k[0] < start + 3)).sum().item() for k in kept) / (2 * 2 * 3)
            assert summary.loc[row.policy, "fact 0 kept"] == pytest.approx(expected)
            by_head = why.facts_kept().set_index(["layer", "kv_head", "fact"]).kept
            assert len(by_head) == 2 * 2  # two layers, two KV heads, one fact
            for (layer, head, _), share in by_head.items():
                assert share == len({p for p in kept[layer][0, head].tolist() if start <= p < start + 3}) / 3
            assert why.coverage.coverage.dropna().lt(0.999).any()  # half the context dropped: not everything covered
    tampered = table.iloc[1].copy()
    tampered["prediction"] = "something else"
    with pytest.raises(ValueError, match="the rerun answered"):
        explain(model, tokenizer, tampered)


def _scores(rows):
    """A results table from (task, example, policy, ratio, mode, score) tuples."""
    table = pd.DataFrame(rows, columns=["task", "example", "policy", "ratio", "mode", "score"])
    return table.assign(dataset="toy", capacity=pd.NA, question=0, model="tiny")


def test_leaderboard_averages_task_means_and_repeats_the_full_cache_in_every_mode():
    rows = [("a", e, "FullCache", 0.0, "full", 1.0) for e in range(4)] + \
           [("b", e, "FullCache", 0.0, "full", float(e < 2)) for e in range(2)] + \
           [("a", e, "SnapKV", 0.5, m, float(e < 2)) for e in range(4) for m in ("query-aware", "query-agnostic")] + \
           [("b", e, "SnapKV", 0.5, m, 0.0) for e in range(2) for m in ("query-aware", "query-agnostic")]
    board = leaderboard(_scores(rows), n_boot=500).set_index(["policy", "mode"])
    # the mean of task means, not of examples: (100 + 100) / 2 for the full cache, (50 + 0) / 2 for SnapKV
    assert board.loc[("FullCache", "query-aware"), "score"] == pytest.approx(100)
    assert board.loc[("FullCache", "query-agnostic"), "score"] == pytest.approx(100)
    assert board.loc[("SnapKV", "query-agnostic"), "score"] == pytest.approx(25)
    low, high = board.loc[("SnapKV", "query-agnostic"), ["low", "high"]]
    assert 0 <= low < 25 < high <= 50  # task b is 0 on every resample; task a's half ranges over [0, 100]
    assert board.loc[("SnapKV", "query-agnostic"), "tasks"] == 2
    per_task = task_scores(_scores(rows), n_boot=0).set_index(["task", "policy", "mode"])
    assert per_task.loc[("a", "SnapKV", "query-aware"), "score"] == pytest.approx(50)


def test_gap_to_the_full_cache_is_paired_by_example():
    # The full cache varies across examples; the policy loses exactly 10 points on each: a paired gap of -10 with
    # no spread, where unpaired intervals would be wide.
    full = np.array([0.2, 0.9, 0.5, 0.7, 0.3])
    rows = [("a", e, "FullCache", 0.0, "full", s) for e, s in enumerate(full)] + \
           [("a", e, "SnapKV", 0.5, "query-aware", s - 0.1) for e, s in enumerate(full)]
    gap = gap_to_full(_scores(rows), n_boot=300).iloc[0]
    assert gap.gap == pytest.approx(-10) and gap.low == pytest.approx(-10) and gap.high == pytest.approx(-10)
    assert gap.full == pytest.approx(100 * full.mean())


def test_a_paired_difference_separates_methods_whose_leaderboard_intervals_overlap(tmp_path):
    # Examples range from easy to hard for both policies; KVzip keeps 10 points more than SnapKV on every example of
    # task a and the same on task b, at ratio 0.5 only (at 0.25 they tie). Hand-worked: (10 + 0) / 2 = 5, no spread.
    easy_to_hard = [0.9, 0.2, 0.6, 0.4, 0.8, 0.1, 0.5, 0.3]
    rows = [(t, e, "FullCache", 0.0, "full", 1.0) for t in "ab" for e in range(8)]
    for ratio, lead in ((0.25, 0.0), (0.5, 0.1)):
        rows += [(t, e, "SnapKV", ratio, "query-agnostic", s) for t in "ab" for e, s in enumerate(easy_to_hard)]
        rows += [(t, e, "KVzip", ratio, "query-agnostic", s + (lead if t == "a" else 0.0))
                 for t in "ab" for e, s in enumerate(easy_to_hard)]
    table = _scores(rows)
    difference = paired_difference(table, baseline="SnapKV", n_boot=300).set_index(["policy", "ratio"])
    assert list(difference.index) == [("KVzip", 0.25), ("KVzip", 0.5)]  # the full cache has no ratio to pair on
    at_half = difference.loc[("KVzip", 0.5)]
    assert (at_half.difference, at_half.low, at_half.high) == pytest.approx((5, 5, 5))
    assert at_half.tasks == 2 and at_half.examples == 16 and at_half.baseline == "SnapKV"
    assert at_half.p == pytest.approx(2 / 2 ** 8)  # exact sign-flip test: 8 nonzero differences, all one way
    # no adjustment over one run's rows: the family is written down across runs (evaluation.family)
    assert not {"p_holm", "separated"} & set(difference.columns)
    assert difference.loc[("KVzip", 0.25), "difference"] == pytest.approx(0)
    assert difference.loc[("KVzip", 0.25), "p"] == pytest.approx(1)
    board = leaderboard(table, n_boot=300).set_index(["policy", "ratio"])
    assert board.loc[("KVzip", 0.5), "low"] < board.loc[("SnapKV", 0.5), "high"]  # unpaired: they overlap

    # mixed signs: KVzip wins one example by 50 and loses the next by 50; the interval straddles 0
    mixed = _scores([("a", e, p, 0.5, "query-aware", s) for e in range(8)
                     for p, s in (("SnapKV", 0.5), ("KVzip", 0.5 + (0.5 if e % 2 else -0.5)))])
    row = paired_difference(mixed, n_boot=500).iloc[0]
    assert row.difference == pytest.approx(0) and row.low < 0 < row.high and row.p == pytest.approx(1)
    # five examples that all agree: the bootstrap interval is a point, but five coin flips agree one time in 16
    five = _scores([("a", e, p, 0.5, "query-aware", s) for e in range(5) for p, s in (("SnapKV", 0.0), ("KVzip", 1.0))])
    row = paired_difference(five, n_boot=200).iloc[0]
    assert row.low == row.high == 100 and row.p == pytest.approx(2 / 32)
    assert row.p_method == "exact" and row.nonzero == 5
    # past 20 nonzero differences of two sizes (no binomial count) the flips are counted by their sums: 21
    # agreeing examples are matched by 2 of the 2^21 sign assignments, all positive and all negative
    many = _scores([("a", e, p, 0.5, "query-aware", s) for e in range(21)
                    for p, s in (("SnapKV", 0.0), ("KVzip", 0.1 + 0.1 * (e == 0)))])
    row = paired_difference(many, n_boot=0, n_perm=2000).iloc[0]
    assert row.p == pytest.approx(2 / 2 ** 21) and row.p_method == "exact" and row.nonzero == 21
    with pytest.raises(ValueError, match="no rows of 'TOVA'"):
        paired_difference(mixed, baseline="TOVA")
    alone = paired_difference(mixed[mixed.policy == "SnapKV"])  # nothing to read against it: no rows, same columns
    assert alone.empty and {"difference", "p", "p_method"} <= set(alone.columns)

    from snapkv_lab.evaluation.leaderboard_plots import draw

    table.to_csv(tmp_path / "eval_toy.csv", index=False)
    names = {p.name for p in draw(tmp_path, tmp_path)}
    assert {"eval_toy_difference.png", "eval_toy_difference.html"} <= names
    page = (tmp_path / "eval_toy_difference.html").read_text()
    assert "ratio=0.25" in page and "ratio=0.5" in page  # a panel per budget, as Holm counted them


def test_a_run_at_several_lengths_is_scored_per_length_as_ruler_reports_it(tmp_path):
    """RULER reports each length on its own: a policy that keeps every needle at 4k and none at 8k scores 100 and 0,
    not a pooled 50, and its gap is paired with the full cache of the same length."""
    from snapkv_lab.evaluation import full_cache_fails
    from snapkv_lab.evaluation.leaderboard_plots import draw

    rows = [("a", f"{n}-0-{e}", "FullCache", 0.0, "full", 1.0) for n in (4096, 8192) for e in range(3)] + \
           [("b", f"{n}-0-{e}", "FullCache", 0.0, "full", float(n == 4096)) for n in (4096, 8192) for e in range(3)] + \
           [(t, f"{n}-0-{e}", "SnapKV", r, "query-aware", float(n == 4096)) for t in "ab" for n in (4096, 8192)
            for e in range(3) for r in (0.25, 0.5)]
    table = _scores(rows).assign(length=lambda t: t.example.str.split("-").str[0].astype(int))
    board = leaderboard(table, n_boot=200).set_index(["length", "policy", "ratio", "mode"])
    assert board.loc[(4096, "SnapKV", 0.5, "query-aware"), "score"] == pytest.approx(100)
    assert board.loc[(8192, "SnapKV", 0.5, "query-aware"), "score"] == pytest.approx(0)
    assert board.loc[(8192, "FullCache", 0.0, "query-aware"), "score"] == pytest.approx(50)  # task b fails at 8k
    assert board.loc[(8192, "SnapKV", 0.5, "query-aware"), "examples"] == 6  # 2 tasks x 3, none from 4k
    gap = gap_to_full(table, n_boot=0).set_index(["length", "task", "ratio"]).gap
    assert gap[(4096, "a", 0.5)] == 0 and gap[(8192, "a", 0.5)] == -100 and gap[(8192, "b", 0.5)] == 0
    assert full_cache_fails(table) == ["b at 8192"]
    assert full_cache_fails(table[table.length == 8192]) == ["b"]
    (tmp_path / "data").mkdir()
    table.assign(model="tiny").to_csv(tmp_path / "data" / "eval_toy.csv", index=False)
    names = {p.name for p in draw(tmp_path / "data", tmp_path)}
    assert ({"eval_toy_4096_leaderboard.png", "eval_toy_8192_gap.html"} <= names
            and "eval_toy_leaderboard.png" not in names)
    assert not any("difference" in name for name in names)  # SnapKV alone: nothing to read against it


def test_the_committed_leaderboard_resumes_under_todays_code():
    """Every committed row's example and policy is a cell today's code would run, in its policy group, so `snapkv-lab
    figures --recompute --only eval` grows the committed run instead of starting a new one beside it (a policy field
    added without ADDED_LATER, a changed default, or a group widened, breaks this)."""
    from pathlib import Path

    from snapkv_lab.evaluation import LEADERBOARD_GROUPS, leaderboard_cells

    table = read_results(Path(__file__).parent.parent / "data" / "eval_ruler.csv")

    def canonical(config):  # the cells hold each policy at its default capacity; the rows, at their budget
        config = {k: canonical(v) if isinstance(v, dict) else v for k, v in config.items() if k != "capacity"}
        return json.dumps(config, sort_keys=True)

    compressed = table[table.policy != "FullCache"]
    assert (table[table.policy == "FullCache"].groupby(["task", "example", "question", "mode"]).size() == 1).all()
    for group in LEADERBOARD_GROUPS:
        rows = compressed[compressed.policy.isin(group)]
        if rows.empty:  # a group whose cells have not run yet
            continue
        cells = leaderboard_cells(None, group, 1, table)
        examples = {json.dumps(cell.config["example"], sort_keys=True) for cell in cells}
        policies = {canonical(policy) for cell in cells for policy in cell.config["policies"]}
        assert set(rows.spec.map(lambda spec: json.dumps(json.loads(spec), sort_keys=True))) <= examples
        missing = set(rows.policy_config.map(lambda c: canonical(json.loads(c)))) - policies
        assert not missing, f"committed rows no cell of today's leaderboard would run: {sorted(missing)[:2]}"
        assert set(rows.policy) == set(group)
    assert set(compressed.policy) <= {name for group in LEADERBOARD_GROUPS for name in group}


def test_joined_tables_keep_each_examples_full_cache_rows_once():
    from snapkv_lab.evaluation import joined_tables

    def rows(policies, examples):
        return pd.DataFrame([dict(dataset="ruler", task=task, example="0", policy=p, score=1.0)
                             for task in examples for p in policies])

    joined = joined_tables([rows(["FullCache", "SnapKV"], ["a", "b"]), rows(["FullCache", "KeyDiff"], ["a", "c"]),
                            rows(["FullCache", "LagKV"], ["c"])])
    full = joined[joined.policy == "FullCache"]
    assert sorted(full.task) == ["a", "b", "c"]  # the same example id in another task is another example
    assert sorted(joined.policy[joined.policy != "FullCache"]) == ["KeyDiff", "KeyDiff", "LagKV", "SnapKV", "SnapKV"]


@pytest.mark.slow
def test_cli_eval_runs_ruler_on_the_bundled_model_and_a_rerun_resumes(tmp_path, capsys):
    from snapkv_lab.app.cli import main
    from snapkv_lab.evaluation.metrics import string_match_all

    data, figures = tmp_path / "data", tmp_path / "figures"
    args = ["eval", "--dataset", "ruler", "--tasks", "niah_single_1", "--limit", "2", "--policies", "SnapKV",
            "--ratios", "0.5", "--lengths", "1024", "--data-dir", str(data), "--figures-dir", str(figures)]
    assert main(args) == 0
    assert "2 to run" in capsys.readouterr().err
    table = read_results(data / "eval_ruler.csv")
    assert len(table) == 2 * (1 + 2) and set(table["mode"]) == {"full", "query-aware", "query-agnostic"}
    assert (table.length == 1024).all() and (table.prompt_tokens <= 1024).all()
    for _, row in table.iterrows():  # each score is the official metric of the row's own prediction
        assert row.score == string_match_all(row.prediction, json.loads(row.references))
    assert table[table["mode"] == "full"].score.mean() == 1  # a single needle at 1k: the full cache finds it
    assert {p.name for p in figures.iterdir()} >= {"eval_ruler_leaderboard.png", "eval_ruler_heatmap.html",
                                                   "eval_ruler_gap.png"}
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "2 already in" in err and "0 to run" in err
    assert main([*args, "--reuse", str(data / "eval_ruler.csv"), str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err
    assert f"--reuse {tmp_path / 'none.csv'}: no such table" in err and "eval_ruler.csv" not in err


def test_recompute_runs_every_group_as_one_sweep_and_keeps_what_the_table_holds(toy, tiny_as_default, tmp_path,
                                                                                monkeypatch, capsys):
    """The leaderboard's groups run as one sweep (one count of cells, so a cluster's workers take any group's cells)
    and only the joined table is written, each example's full-cache rows once. With reuse, a fresh clone grows the
    committed table by the examples --samples adds, and a smaller --samples keeps the examples it holds beyond it."""
    import snapkv_lab.evaluation as evaluation

    monkeypatch.setattr(evaluation, "LEADERBOARD", dict(datasets=["toy"], lengths=[], ratios=[0.5],
                                                        modes=["query-aware", "query-agnostic"]))
    monkeypatch.setattr(evaluation, "LEADERBOARD_GROUPS", (("SnapKV(window_size=8)",), ("StreamingLLM(kept_tail=8)",)))
    evaluation.recompute(dict(data_dir=str(tmp_path / "first"), samples=2))
    assert "eval cells: 4 cells, 0 already in" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "first").glob("*.csv")) == ["eval_ruler.csv"]
    first = read_results(tmp_path / "first" / "eval_ruler.csv")
    assert sorted(first.policy.unique()) == ["FullCache", "SnapKV(window_size=8)", "StreamingLLM(kept_tail=8)"]
    assert (first[first.policy == "FullCache"].groupby(["example", "question"]).size() == 1).all()
    assert set(first.example) == {"0", "1"}

    clone = tmp_path / "clone"  # a fresh clone: the committed table, no cells
    clone.mkdir()
    (clone / "eval_ruler.csv").write_text((tmp_path / "first" / "eval_ruler.csv").read_text())
    evaluation.recompute(dict(data_dir=str(clone), samples=3, reuse=True))
    err = capsys.readouterr().err
    assert "4 taken whole" in err and "6 cells, 4 already in" in err and "2 to run" in err
    grown = read_results(clone / "eval_ruler.csv")
    assert set(grown.example) == {"0", "1", "2"}
    timings = ["prefill_s", "selection_s", "decode_ms_per_token"]
    assert (grown[grown.example != "2"].drop(columns=timings).to_csv(index=False)
            == first.drop(columns=timings).to_csv(index=False))

    again = tmp_path / "again"
    again.mkdir()
    (again / "eval_ruler.csv").write_text((clone / "eval_ruler.csv").read_text())
    evaluation.recompute(dict(data_dir=str(again), samples=1, reuse=True))
    assert "0 to run" in capsys.readouterr().err
    assert (again / "eval_ruler.csv").read_text() == (clone / "eval_ruler.csv").read_text()

    evaluation.recompute(dict(data_dir=str(again), samples={"twice": 1}, reuse=True))  # one task grown, alone
    assert "8 cells, 6 already in" in capsys.readouterr().err
    both = read_results(again / "eval_ruler.csv")
    assert both.groupby("task").example.unique().map(list).to_dict() == {"repeat": ["0", "1", "2"], "twice": ["0"]}
    assert both[both.task == "repeat"].to_csv(index=False) == grown.to_csv(index=False)


def test_an_earlier_table_stands_in_for_the_cells_it_answers_whole(toy, tiny_as_default, tmp_path, capsys):
    """reuse: the examples an earlier (joined) table answers whole are stored from its rows, each group's cells
    alike; a new example runs; another budget, or a missing answer, leaves the cell to run."""
    from snapkv_lab.evaluation import joined_tables

    groups = (["SnapKV(window_size=8)"], ["StreamingLLM(kept_tail=8)"])
    options = dict(datasets=["toy"], tasks=["twice"], ratios=[0.5], modes=["query-agnostic", "query-aware"],
                   write=False)
    first = [evaluate(policies=group, limit=2, data_dir=tmp_path / "first", **options) for group in groups]
    earlier = joined_tables(first)
    earlier.to_csv(tmp_path / "earlier.csv", index=False)
    earlier = read_results(tmp_path / "earlier.csv")  # as a fresh clone reads the committed table
    capsys.readouterr()
    grown = [evaluate(policies=group, limit=3, data_dir=tmp_path / "grown", reuse=earlier, **options)
             for group in groups]
    err = capsys.readouterr().err
    assert err.count("2 taken whole") == 2 and err.count("1 to run") == 2
    for before, after in zip(first, grown):
        old = after[after.example != "2"]
        pd.testing.assert_frame_equal(old[old.policy != "FullCache"].reset_index(drop=True),
                                      before[before.policy != "FullCache"].reset_index(drop=True), check_dtype=False)
        assert set(after.example) == {"0", "1", "2"}
    timings = ["prefill_s", "selection_s", "decode_ms_per_token"]
    joined = joined_tables(grown)
    assert (joined[joined.example != "2"].drop(columns=timings).to_csv(index=False)
            == earlier.drop(columns=timings).to_csv(index=False))  # the reused rows as written, in their order

    evaluate(policies=groups[0], limit=2, data_dir=tmp_path / "other", reuse=earlier,
             **{**options, "ratios": [0.25]})
    assert "0 taken whole" in capsys.readouterr().err
    gap = earlier.drop(index=earlier.index[(earlier.example == "1") & earlier.policy.str.startswith("SnapKV")][0])
    evaluate(policies=groups[0], limit=2, data_dir=tmp_path / "gap", reuse=gap, **options)
    assert "1 taken whole" in capsys.readouterr().err


def test_runs_at_different_ratios_join_into_the_run_at_all_of_them(toy, tiny_as_default, tmp_path, capsys):
    """reuse takes several tables: a run at ratio 0.5 and one at 0.25 (over the same examples) answer a run at both
    whole, and the joined table is the one a fresh run at both writes, row for row; a table missing a ratio leaves
    the cells to run."""
    options = dict(datasets=["toy"], tasks=["twice"], policies=["SnapKV(window_size=8)", "StreamingLLM(kept_tail=8)"],
                   modes=["query-agnostic", "query-aware"], limit=2)
    for ratio in (0.5, 0.25):
        evaluate(ratios=[ratio], data_dir=tmp_path / str(ratio), **options)
    fresh = evaluate(ratios=[0.25, 0.5], data_dir=tmp_path / "fresh", **options)
    capsys.readouterr()
    tables = [tmp_path / "0.5" / "eval_toy.csv", tmp_path / "0.25" / "eval_toy.csv"]
    joined = evaluate(ratios=[0.25, 0.5], data_dir=tmp_path / "joined", reuse=tables, **options)
    err = capsys.readouterr().err
    assert "2 taken whole" in err and "0 to run" in err
    timings = ["prefill_s", "selection_s", "decode_ms_per_token"]
    assert sorted(joined.ratio.unique()) == [0.0, 0.25, 0.5]
    assert joined.drop(columns=timings).to_csv(index=False) == fresh.drop(columns=timings).to_csv(index=False)

    evaluate(ratios=[0.25, 0.5, 0.75], data_dir=tmp_path / "short", reuse=tables, **options)
    assert "0 taken whole" in capsys.readouterr().err


def test_the_committed_leaderboard_is_reused_whole_by_a_fresh_clone(tmp_path):
    """The committed eval_ruler.csv answers every cell of its examples under today's leaderboard, so `--reuse` grows
    it by new examples only, and the table rebuilt from the reused cells is the committed file, byte for byte."""
    from pathlib import Path

    from snapkv_lab.evaluation import LEADERBOARD_GROUPS, joined_tables, leaderboard_cells, reuse_rows
    from snapkv_lab.sweep import ResultStore

    path = Path(__file__).parent.parent / "data" / "eval_ruler.csv"
    committed = read_results(path)
    store, tables = ResultStore(tmp_path), []
    for group in LEADERBOARD_GROUPS:
        if not committed.policy.isin(group).any():
            continue
        cells = leaderboard_cells(None, group, 1, committed)  # the first example per task, and every one it holds
        examples = committed.groupby(["task", "example"]).ngroups
        assert len(cells) == examples and reuse_rows(cells, store, committed) == examples
        tables.append(store.table(cells))
    assert joined_tables(tables).to_csv(index=False) == path.read_text()


def test_cli_eval_says_when_it_replaces_a_table_holding_more(tmp_path, monkeypatch, capsys):
    """A quick look run in the repository writes data/eval_ruler.csv over the committed leaderboard: said, not
    silent."""
    import snapkv_lab.evaluation as evaluation
    from snapkv_lab.app.cli import main

    def table(specs, policies):
        return pd.DataFrame([dict(spec=s, policy=p, score=1.0) for s in specs for p in policies])

    def fake_evaluate(model, *, data_dir, **options):
        written = table(["a"], ["FullCache", "SnapKV"])
        written.to_csv(Path(data_dir) / "eval_ruler.csv", index=False)
        return written.assign(dataset="ruler", task="niah_single_1", example="0")

    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    monkeypatch.setattr(evaluation, "draw", lambda *args, **kwargs: [])
    args = ["eval", "--tasks", "niah_single_1", "--limit", "1", "--policies", "SnapKV", "--ratios", "0.5",
            "--data-dir", str(tmp_path), "--figures-dir", str(tmp_path / "figures")]
    table(["a", "b"], ["FullCache", "SnapKV", "TOVA"]).to_csv(tmp_path / "eval_ruler.csv", index=False)
    assert main(args) == 0
    assert "held examples and policies this run does not have" in capsys.readouterr().err
    assert main(args) == 0  # the same run again replaces nothing it lacks
    assert "note:" not in capsys.readouterr().err


def test_cli_eval_draws_beside_its_tables_unless_told(tmp_path, monkeypatch, capsys):
    """A run kept apart by --data-dir draws into <data-dir>/figures, not over the repository's figures/; the
    repository's data/ keeps figures/; --figures-dir wins; another model draws in its own subfolder of either. The
    closing line counts examples per task (an example id repeats across tasks)."""
    import snapkv_lab.evaluation as evaluation
    import snapkv_lab.models
    from snapkv_lab.app.cli import main

    drawn = []
    monkeypatch.setattr(snapkv_lab.models, "check_model", lambda model: None)
    # two tasks' first examples share an id: two examples all the same
    monkeypatch.setattr(evaluation, "evaluate", lambda model, **options: pd.DataFrame(dict(
        dataset="ruler", task=["vt", "vt", "cwe"], example=["4096-0-0"] * 3)))
    monkeypatch.setattr(evaluation, "draw", lambda data_dir, figures_dir, names, peers=None: drawn.append(
        (Path(data_dir), Path(figures_dir))) or [])
    monkeypatch.chdir(tmp_path)
    quick = ["eval", "--tasks", "niah_single_1", "--limit", "1", "--policies", "SnapKV", "--ratios", "0.5"]
    for options, expected in ((["--data-dir", "runs/a"], ("runs/a", "runs/a/figures")),
                              ([], ("data", "figures")),
                              (["--data-dir", "data"], ("data", "figures")),
                              (["--data-dir", str(tmp_path / "data")], (tmp_path / "data", "figures")),
                              (["--data-dir", "runs/a", "--figures-dir", "plots"], ("runs/a", "plots")),
                              (["--data-dir", "runs/a", "--model", "gemma-3-270m"],
                               ("runs/a/gemma-3-270m", "runs/a/figures/gemma-3-270m"))):
        assert main([*quick, *options]) == 0
        assert drawn.pop() == tuple(map(Path, expected)), options
        assert re.fullmatch(r"3 answers \(2 examples\) in \d+ s\n", capsys.readouterr().out)


def test_figure_titles_count_tasks_and_examples_in_words():
    from snapkv_lab.evaluation.leaderboard_plots import _title, counted

    one = _scores([("a", 0, "FullCache", 0.0, "full", 1.0), ("a", 0, "SnapKV", 0.5, "query-aware", 0.0)])
    assert _title(one, "Score").endswith("toy, 1 task, 1 example per task")
    two = _scores([(t, e, "FullCache", 0.0, "full", 1.0) for t in ("a", "b") for e in range(2)])
    assert _title(two, "Score").endswith("toy, 2 tasks, 2 examples per task")
    assert [counted(n, "example") for n in (0, 1, 3)] == ["0 examples", "1 example", "3 examples"]


def test_a_budget_audit_recomputes_the_entries_a_run_recorded(toy, tiny_as_default, tmp_path):
    """audit_entries, given a table whose entry columns are gone (a table stored before they existed), refills them
    from compressions rebuilt without decoding: the same numbers the run recorded, row for row, for every policy x
    ratio x mode and the full cache; an example that no longer rebuilds to the recorded context is refused."""
    from snapkv_lab.evaluation.audit import COLUMNS, audit_entries, entries_of, fill_from_entries

    options = dict(datasets=["toy"], tasks=["twice"], policies=["SnapKV(window_size=8)", "PyramidKV(window_size=8)",
                                                                 "AdaKV(SnapKV(window_size=8))"],
                   modes=["query-agnostic", "query-aware"], limit=2, ratios=[0.25, 0.5])
    table = evaluate(data_dir=tmp_path / "run", **options)
    assert set(COLUMNS) <= set(table.columns) and table.kv_entries.gt(0).all()
    full = table[table["mode"] == "full"]
    assert (full.kv_share == 1).all() and not table.over_budget.any()
    older = table.drop(columns=COLUMNS)
    audited = audit_entries(older, model=None, data_dir=tmp_path / "audit")
    assert list(audited.columns) == list(table.columns)
    pd.testing.assert_frame_equal(audited[COLUMNS].reset_index(drop=True), table[COLUMNS].reset_index(drop=True),
                                  check_dtype=False)
    first = older.spec == older.spec.iloc[0]  # an audit in parts: the first example, the other's columns left empty
    part = audit_entries(older, model=None, data_dir=tmp_path / "part", examples=1)
    pd.testing.assert_frame_equal(part.loc[first, COLUMNS].reset_index(drop=True),
                                  table.loc[first, COLUMNS].reset_index(drop=True), check_dtype=False)
    assert (~first).any() and part.loc[~first, COLUMNS].isna().all().all()
    rest = audit_entries(older, model=None, data_dir=tmp_path / "part", first=1)  # the other part, side by side
    pd.testing.assert_frame_equal(rest.loc[~first, COLUMNS].reset_index(drop=True),
                                  table.loc[~first, COLUMNS].reset_index(drop=True), check_dtype=False)
    assert rest.loc[first, COLUMNS].isna().all().all()
    # The parts' entries, as --entries-only writes them and data/budget_audit_*.csv keeps them, fill the older table
    # without recomputing: every row as the run recorded it; one part alone is refused, not half filled.
    entries = pd.concat([entries_of(part, "t.csv"), entries_of(rest, "t.csv"), entries_of(rest, "other.csv")])
    filled = fill_from_entries(older, entries, "t.csv")
    assert list(filled.columns) == list(table.columns)
    pd.testing.assert_frame_equal(filled[COLUMNS].reset_index(drop=True), table[COLUMNS].reset_index(drop=True),
                                  check_dtype=False)
    with pytest.raises(ValueError, match="not in the audit"):
        fill_from_entries(older, entries_of(part, "t.csv"), "t.csv")
    with pytest.raises(ValueError, match="selects none of them"):  # examples is where a part ends: [1:1] is empty
        audit_entries(older, model=None, data_dir=tmp_path / "part", first=1, examples=1)

    changed = older.assign(context_tokens=older.context_tokens + 1)
    with pytest.raises(ValueError, match="cannot be recomputed"):
        audit_entries(changed, model=None, data_dir=tmp_path / "changed")


def test_budget_records_say_which_tables_record_what_their_rows_held(tmp_path):
    """Each table of runs is recorded, audited (whole or in part, by a budget_audit_*.csv of its folder) or not;
    summaries without a cache-size column and stored cells are no tables of runs."""
    from snapkv_lab.evaluation.audit import budget_records

    def table(name, examples, **columns):
        rows = pd.DataFrame(dict(model="m", task="t", example=[str(e) for e in examples], policy="SnapKV",
                                 kept_tokens=10, **columns))
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        rows.to_csv(tmp_path / name, index=False)

    table("recorded.csv", [0, 1], kv_entries=5)
    table("whole.csv", [0, 1], spec="{}", policy_config="{}")
    table("part.csv", [0, 1, 2], spec="{}", policy_config="{}")
    table("none.csv", [0])
    table("filled.csv", [0], kv_entries=5, spec="{}", policy_config="{}")
    table("cells/eval/x.csv", [0])
    pd.DataFrame(dict(policy=["SnapKV"], p=[0.5])).to_csv(tmp_path / "summary.csv", index=False)
    pd.DataFrame(dict(table=["whole.csv", "whole.csv", "part.csv", "recorded.csv", "filled.csv"], model="m", task="t",
                      example=["0", "1", "2", "0", "0"])).to_csv(tmp_path / "budget_audit_m.csv", index=False)
    # needle tables (no examples: contexts) in a model's folder, filled whole from that folder's needle audit or not
    needle = dict(task="needle", policy="SnapKV", capacity=64, mode="query-aware", cache_length=64)
    (tmp_path / "other").mkdir()
    for name in ("pressure_a.csv", "pressure_b.csv"):
        pd.DataFrame([dict(needle, kv_entries=5)]).to_csv(tmp_path / "other" / name, index=False)
    pd.DataFrame([needle]).to_csv(tmp_path / "other" / "pressure_c.csv", index=False)
    pd.DataFrame(dict(table=["pressure_a.csv"], spec="{}", key="k")).to_csv(
        tmp_path / "other" / "budget_audit_needles.csv", index=False)
    records = budget_records(tmp_path).set_index("table")
    needles = records.loc[["other/pressure_a.csv", "other/pressure_b.csv", "other/pressure_c.csv"]]
    assert needles.record.tolist() == ["filled from an audit", "recorded", "not recorded"]
    assert needles.auditable.all() and needles.known.tolist() == [True, True, False]
    records = records.drop(needles.index)
    assert sorted(records.index) == ["filled.csv", "none.csv", "part.csv", "recorded.csv", "whole.csv"]
    assert records.record.to_dict() == {"filled.csv": "filled from an audit", "none.csv": "not recorded",
                                        "part.csv": "audited in part", "recorded.csv": "recorded",
                                        "whole.csv": "audited"}
    assert records.audited.to_dict() == {"filled.csv": 1, "none.csv": 0, "part.csv": 1, "recorded.csv": 1,
                                         "whole.csv": 2}
    assert records.auditable.to_dict() == {"filled.csv": True, "none.csv": False, "part.csv": True,
                                           "recorded.csv": False, "whole.csv": True}
    assert records.loc["part.csv", "examples"] == 3 and records.loc["part.csv", "rows"] == 3
    assert sorted(records.index[records.known]) == ["filled.csv", "recorded.csv", "whole.csv"]


def test_the_leaderboard_flags_a_policy_that_held_more_than_its_budget(toy, tiny_as_default, tmp_path):
    """A per-query-head SnapKV holds its budget once per query head (twice the KV heads' budget on the tiny model): its
    rows are over_budget and its leaderboard rows say so, the KV-head SnapKV's do not; kv_share rides along."""
    table = evaluate(datasets=["toy"], tasks=["repeat"], limit=1, ratios=[0.5], modes=["query-agnostic"],
                     policies=["SnapKV(window_size=8)", "SnapKV(window_size=8, per_query_head=True)"],
                     data_dir=tmp_path)
    board = leaderboard(table).set_index("policy")
    wide = next(p for p in board.index if "per_query_head" in p)
    assert board.loc[wide, "over_budget"] and board.loc[wide, "kv_share"] == pytest.approx(1.0, abs=0.02)
    assert not board.loc["SnapKV(window_size=8)", "over_budget"]
    assert board.loc["SnapKV(window_size=8)", "kv_share"] == pytest.approx(0.5, abs=0.02)
    assert not board.loc["FullCache", "over_budget"] and board.loc["FullCache", "kv_share"] == 1
