"""The long-generation pressure test: the list task, its scores (hand-worked), and the runner on the tiny model."""

from __future__ import annotations

from conftest import make_tiny_llama

import snapkv_lab as C
from snapkv_lab.pressure.long_generation import decoding_policies, list_scores, list_task, long_generation


def test_list_task_is_seeded_and_its_codes_distinct():
    text, codes = list_task(30, seed=4)
    assert (text, codes) == list_task(30, seed=4) and codes != list_task(30, seed=5)[1]
    assert len(set(codes)) == 30 and all(len(c) == 5 for c in codes)
    assert "1. " + codes[0] + "\n" in text and "30. " + codes[29] + "\n" in text


def test_scores_count_the_right_codes_and_stop_in_order_at_the_first_mistake():
    codes = ["11111", "22222", "33333", "44444"]
    assert list_scores("1. 11111\n2. 22222\n3. 33333\n4. 44444", codes) == {"in_order": 1.0, "correct": 1.0}
    # line 3 wrong: two in order; lines 1, 2 and 4 right; chatter between lines is skipped
    assert list_scores("Sure:\n1. 11111\n2. 22222\n3. 99999\n4. 44444", codes) == {"in_order": 0.5, "correct": 0.75}
    # a skipped number breaks the order, not the later lines' correctness; a repeated number keeps its first code
    assert list_scores("1. 11111\n3. 33333\n3. 12345", codes) == {"in_order": 0.25, "correct": 0.5}
    assert list_scores("", codes) == {"in_order": 0.0, "correct": 0.0}


def test_every_policy_and_the_full_cache_copy_each_list(byte_tokenizer):
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=2)
    table = long_generation(model, byte_tokenizer, [C.RKV(capacity=0.5, interval=16), C.H2O(capacity=0.5)],
                            n_items=4, seeds=(0, 1), tokens_per_item=6, progress=False)
    assert list(table.policy) == ["FullCache", "RKV(interval=16)@0.5", "H2O@0.5"] * 2
    assert table.in_order.between(0, 1).all() and table.correct.between(0, 1).all()
    full = table[table.policy == "FullCache"]
    assert (full.cache_after_prefill == full.prompt_tokens).all()
    assert (table[table.policy != "FullCache"].cache_after_prefill < full.prompt_tokens.max()).all()
    # the footprint's steps are the generated tokens: the full cache holds prompt + t entries per head and layer at t
    steps = full.new_tokens
    heads = 2 * 2
    expected = heads * (full.prompt_tokens * steps + steps * (steps - 1) // 2)
    assert (full.footprint_integral == expected).all()
    assert (full.footprint_peak == heads * (full.prompt_tokens + steps - 1)).all()


def test_decoding_policies_name_kvpress_presses_and_a_rerun_skips_done_cells(byte_tokenizer):
    labels = [p.label for p in decoding_policies(48)]
    assert labels == ["DecodingEviction@48", "DecodingEviction(target=48)", "RKV(interval=32)@48", "H2O@48",
                      "TOVA@48"]
    model = make_tiny_llama(initializer_range=0.3, num_hidden_layers=2)
    seen = []
    table = long_generation(model, byte_tokenizer, [C.H2O(capacity=16)], n_items=3, seeds=(0, 1), tokens_per_item=4,
                            progress=False, skip={("FullCache", 0), ("H2O@16", 1)}, on_row=seen.append)
    assert list(zip(table.policy, table.seed)) == [("H2O@16", 0), ("FullCache", 1)] and len(seen) == 2
    assert table.budget.isna().tolist() == [False, True]
    assert (table[table.policy == "H2O@16"].footprint_peak <= 4 * 16).all()


def test_the_list_ends_generation_once_its_last_line_is_written(byte_tokenizer):
    from snapkv_lab.pressure.long_generation import list_written

    def ids(text):
        return [list(text.encode())]

    done = list_written(byte_tokenizer, 3)
    assert not done(ids("1. 11111\n2. 22222\n3. 33333")) and done(ids("1. 11111\n2. 22222\n3. 33333\n"))
    assert not done(ids("13. 12345\n")) and not done(ids("x 3. 12345\n"))


def test_summary_intervals_and_the_figure_from_a_table(tmp_path):
    import pandas as pd

    from snapkv_lab.pressure.long_generation import long_generation_summary
    from snapkv_lab.pressure.long_generation_plots import long_generation_figure

    rows = [dict(policy=p, seed=s, n_items=4, budget=b, correct=c, in_order=c, new_tokens=n, stopped="list",
                 max_new_tokens=40, footprint_integral=f, footprint_peak=f // 10)
            for p, b, cs, n, f in (("FullCache", None, (1.0, 0.5, 0.75), 30, 9000),
                                   ("H2O@48", 48, (0.5, 0.5, 0.25), 40, 4000))
            for s, c in enumerate(cs)]
    table = pd.DataFrame(rows)
    summary = long_generation_summary(table).set_index("policy")
    assert summary.loc["FullCache", "correct"] == 0.75 and summary.loc["H2O@48", "lists"] == 3
    # H2O minus the full cache, list by list: -0.5, 0, -0.5; mean -1/3, sd 0.2887, t_{2, 0.975} = 4.3027
    half = 4.302653 * 0.288675 / 3 ** 0.5
    assert abs(summary.loc["H2O@48", "correct_vs_full"] + 1 / 3) < 1e-9
    assert abs(summary.loc["H2O@48", "correct_vs_full_high"] - (-1 / 3 + half)) < 1e-4
    assert summary.loc["FullCache", "footprint_integral_low"] == summary.loc["FullCache", "footprint_integral"]
    written = long_generation_figure(table, tmp_path / "long_generation")
    assert [p.name for p in written] == ["long_generation.png"] and written[0].stat().st_size > 0
