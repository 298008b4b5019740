"""SCBench's multi-turn mode (evaluation.multiturn) and compressing a live cache again (compressor.compress_again).

The three-turn case below is worked by hand from the official code (microsoft/MInference fb56c91): what each turn
feeds, at which position, and when compression runs, for both feeds and both compress options. It is written from
eval_utils.py (create_multiturn_prompt, GreedySearch._decode/_process_texts) and kvcompression.py (compress at the
first prefill, append afterwards), not from our implementation's output.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama

from snapkv_lab.compression import SharedPrefill
from snapkv_lab.compression.compressor import compress, compress_again
from snapkv_lab.compression.greedy import forward
from snapkv_lab.evaluation import multiturn
from snapkv_lab.evaluation.examples import Example, Question
from snapkv_lab.policies import SnapKV, parse_policy

FIXTURES = "tests/fixtures/eval/scbench-multiturn"


# --- the engine: compress the live cache again ------------------------------------------------------------------

def test_compressing_again_is_one_more_chunk_of_a_chunked_prefill():
    """A prompt compressed at its prefill, then a feed compressed again, keeps what a chunked prefill of the same two
    chunks keeps (the same scoring path), and gives the same logits."""
    model = make_tiny_llama()
    torch.manual_seed(1)
    prompt, turn = torch.randint(2, 256, (1, 48)), torch.randint(2, 256, (1, 20))
    policy = SnapKV(capacity=24, window_size=4)
    with compress(model, policy, prefill_chunk=48) as chunked:
        forward(model, prompt, chunked.cache, 0)
        expected = forward(model, turn, chunked.cache, 48)
        chunked.end_prefill()
    with compress(model, policy) as state:
        forward(model, prompt, state.cache, 0)
    logits = compress_again(model, state, turn, 48, 24)
    for layer, kept in chunked.kept_indices.items():
        assert torch.equal(state.kept_indices[layer], kept)
        assert state.kept_indices[layer].shape[-1] == 24  # back to the budget: 24 of the 24 held + 20 fed
    assert int(state.kept_indices[0].max()) == 67  # the feed's last token (a window vote) is held
    torch.testing.assert_close(logits, expected)
    assert state.policy is policy  # its label is the run's


def test_compressing_again_refuses_what_a_chunk_cannot_take():
    model = make_tiny_llama()
    ids = torch.randint(2, 256, (1, 40))
    policy = dataclasses.replace(parse_policy("AdaKV(SnapKV(window_size=4))"), capacity=16)
    state = SharedPrefill.run(model, ByteTokenizer(), ids, [policy]).state(policy)
    with pytest.raises(NotImplementedError, match="head-wise"):
        compress_again(model, state, ids[:, :8], 40, 16)


# --- the hand-worked three-turn case ------------------------------------------------------------------------------

def _three_turns(tokenizer, feed):
    example = Example(dataset="scbench", task="scbench_kv", id="0", context="CTX", metric="scbench_kv",
                      questions=(Question("Q1", ("G1",)), Question("Q2", ("G2",)), Question("Q3", ("G3",))),
                      max_new_tokens=3, meta={"golds": ["G1", "G2", "G3"]})
    return multiturn.conversation(tokenizer, example, feed, "plain")


def _events(monkeypatch, feed, compress_option, mode, answers):
    """Run converse on the tiny model, recording each feed (text, first position), compression, and answer (the
    tokens the cache held before it); `answers`: the token ids each turn's stubbed answer generates."""
    model, tokenizer = make_tiny_llama(), ByteTokenizer()
    turns = _three_turns(tokenizer, feed)
    events = []
    text = lambda ids: bytes(ids[0].tolist()).decode()  # noqa: E731
    real_forward, real_again = multiturn.forward, multiturn.compress_again

    def feed_plain(model, ids, cache, start, mask=None):
        events.append(("feed", text(ids), start))
        return real_forward(model, ids, cache, start, mask)

    def feed_compressing(model, state, ids, start, capacity):
        events.append(("compress", text(ids), start, capacity))
        return real_again(model, state, ids, start, capacity)

    def stub_answer(model, tokenizer, state, logits, ids, questions, extras, **kwargs):
        events.append(("answer", ids.shape[1]))
        return [SimpleNamespace(token_ids=torch.tensor([answers[kwargs["question_index"]]]))]

    monkeypatch.setattr(multiturn, "forward", feed_plain)
    monkeypatch.setattr(multiturn, "compress_again", feed_compressing)
    monkeypatch.setattr(multiturn, "answer", stub_answer)
    policy = SnapKV(capacity=2, window_size=1)
    shared = SharedPrefill.run(model, tokenizer, torch.tensor([turns[0].lead]), [policy])
    real_extend = shared.extend

    def extend(ids):
        events.append(("prefill", "CTX" + text(ids), 0))
        return real_extend(ids)

    shared.extend = extend
    flags = [again for _, again in multiturn.converse(model, tokenizer, shared, turns, policy, mode, feed,
                                                      compress_option, ["Q1", "Q2", "Q3"])]
    return events, flags


# Turn 1: "CTX" + "\n\nQ1" (multiturn_templates: "{context}\n\n{input}"). Plain framing, as without a chat template.
# Gold (eval_utils.py:117-134, multiturn_follow_up_templates "{pre_ans}\n\n{input}"): turn t opens with the previous
# reference answer and "\n\n"; the model's tokens never stay. Model (--disable_golden_context): the follow-up is the
# query alone, after every generated token but the last; an answer cut by max_new_tokens is followed by the EOS.
# Answers stubbed: turn 1 "ab" then EOS (0); turn 2 "cde" cut at 3 tokens; turn 3 "f" then EOS.
ANSWERS = [[97, 98, 0], [99, 100, 101], [102, 0]]
GOLD_TEXTS = ["G1\n\nQ2", "G2\n\nQ3"]
MODEL_TEXTS = ["abQ2", "cd\x00Q3"]  # "ab" (EOS not fed), "cd" (the last of "cde" never fed) + EOS, then the query


@pytest.mark.parametrize("feed,later", [("gold", GOLD_TEXTS), ("model", MODEL_TEXTS)])
def test_query_aware_once_compresses_the_first_prompt_only(monkeypatch, feed, later):
    events, flags = _events(monkeypatch, feed, "once", "query-aware", ANSWERS)
    # kvcompression.py: the first prefill (context and first query) compressed, every later prompt appended
    assert events == [("prefill", "CTX\n\nQ1", 0), ("answer", 7),
                      ("feed", later[0], 7), ("answer", 7 + len(later[0])),
                      ("feed", later[1], 7 + len(later[0])), ("answer", 7 + len(later[0]) + len(later[1]))]
    assert flags == [True, False, False]


@pytest.mark.parametrize("feed,later", [("gold", GOLD_TEXTS), ("model", MODEL_TEXTS)])
def test_query_aware_every_turn_compresses_each_prompt_with_its_query(monkeypatch, feed, later):
    events, flags = _events(monkeypatch, feed, "every-turn", "query-aware", ANSWERS)
    # the first compression keeps 2 tokens (capacity 2 of 7): every later one cuts the live cache back to 2
    assert events == [("prefill", "CTX\n\nQ1", 0), ("answer", 7),
                      ("compress", later[0], 7, 2), ("answer", 7 + len(later[0])),
                      ("compress", later[1], 7 + len(later[0]), 2),
                      ("answer", 7 + len(later[0]) + len(later[1]))]
    assert flags == [True, True, True]


@pytest.mark.parametrize("feed,leads,queries", [("gold", ["G1\n\n", "G2\n\n"], ["Q2", "Q3"]),
                                                 ("model", ["ab", "cd\x00"], ["Q2", "Q3"])])
@pytest.mark.parametrize("option", ["once", "every-turn"])
def test_query_agnostic_compresses_what_precedes_each_query(monkeypatch, feed, leads, queries, option):
    events, flags = _events(monkeypatch, feed, option, "query-agnostic", ANSWERS)
    # turn 1: the context alone compressed (3 tokens, capacity 2), then "\n\nQ1" fed; later turns: the lead, compressed
    # again under every-turn (back to 2), plainly appended under once; the query always appended after
    lead = "compress" if option == "every-turn" else "feed"
    at2 = 7 + len(leads[0])  # where turn 2's query starts: after "CTX\n\nQ1" (7) and its lead
    at3 = at2 + 2 + len(leads[1])  # after "Q2" and turn 3's lead
    extra = (2,) if option == "every-turn" else ()
    assert events == [("feed", "\n\nQ1", 3), ("answer", 7),
                      (lead, leads[0], 7, *extra), ("feed", queries[0], at2), ("answer", at2 + 2),
                      (lead, leads[1], at2 + 2, *extra), ("feed", queries[1], at3), ("answer", at3 + 2)]
    assert flags == [True, option == "every-turn", option == "every-turn"]


def test_follow_up_prompts_are_scbench_chat_turns():
    """eval_utils.py:478-520 with a ChatML template that adds a default system turn (as SmolLM2's does)."""

    class ChatML(ByteTokenizer):
        chat_template = "chatml"

        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
            if messages[0]["role"] != "system":
                messages = [{"role": "system", "content": "You are Smol"}, *messages]
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    tokenizer = ChatML()
    # gold: [system "", assistant G1, user Q2] less the rendering of [system ""] with its generation prompt
    assert multiturn.follow_up(tokenizer, "Q2", "G1") == (
        "G1<|im_end|>\n<|im_start|>user\n", "Q2<|im_end|>\n<|im_start|>assistant\n")
    # model: [user Q2] less the rendering of [system ""] without one: the default system turn is not removed
    assert multiturn.follow_up(tokenizer, "Q2", None) == (
        "<|im_start|>system\nYou are Smol<|im_end|>\n<|im_start|>user\n", "Q2<|im_end|>\n<|im_start|>assistant\n")
    assert multiturn.follow_up(tokenizer, "Q2", "G1", chat=False) == ("G1\n\n", "Q2")


def test_bad_multi_turn_options_are_refused():
    with pytest.raises(ValueError, match="--dataset scbench alone"):
        multiturn.check_multi_turn(["ruler"], ["scbench_kv"], ["gold"], ["once"], None)
    with pytest.raises(ValueError, match="scbench_mf"):
        multiturn.check_multi_turn(["scbench"], ["scbench_mf"], ["gold"], ["once"], None)
    with pytest.raises(ValueError, match="feeds must be among"):
        multiturn.check_multi_turn(["scbench"], ["scbench_kv"], ["oracle"], ["once"], None)
    with pytest.raises(ValueError, match="compress must be among"):
        multiturn.check_multi_turn(["scbench"], ["scbench_kv"], ["gold"], ["never"], None)


# --- end to end, on an offline fixture in SCBench's schema --------------------------------------------------------

def test_a_multi_turn_run_scores_every_turn(tmp_path, monkeypatch):
    from snapkv_lab.core.models import model_name
    from snapkv_lab.evaluation import evaluate, scbench

    monkeypatch.setitem(scbench.MAX_NEW_TOKENS, "scbench_kv", 3)  # a random model never ends: keep answers short
    monkeypatch.setattr("snapkv_lab.sweep.executors._load_model", lambda name: (_named(model_name(None)),
                                                                                   ByteTokenizer()))
    table = evaluate(datasets=["scbench"], tasks=["scbench_kv"], multi_turn=True, policies=["SnapKV(window_size=4)",
                     "AdaKV(SnapKV(window_size=4))"], ratios=[0.5], source=FIXTURES, data_dir=tmp_path, write=False)
    turns = json.loads(open(f"{FIXTURES}/scbench_kv.jsonl").readline())["multi_turns"]
    assert sorted(table.turn.unique()) == [1, 2, 3] and len(turns) == 3
    # per feed: the full cache once; SnapKV in 2 modes x 2 options; AdaKV in 2 modes, once only (every-turn refused)
    per_feed = table.groupby("feed").size()
    assert per_feed.to_dict() == {"gold": 3 * (1 + 4 + 2), "model": 3 * (1 + 4 + 2)}
    assert set(table.compress) == {"none", "once", "every-turn"}
    assert table.score.between(0, 1).all() and (table.metric == "scbench_kv").all()
    assert (table[table.turn == 1].references == json.dumps([turns[0]["answer"]])).all()
    every = table[(table.compress == "every-turn") & (table["mode"] == "query-aware")]
    assert every.recompressed.all()
    once = table[(table.compress == "once") & (table["mode"] == "query-aware") & (table.turn > 1)]
    assert not once.recompressed.any()
    # compressed again, the cache holds fewer entries at turn 3 than when the later turns were only appended
    assert every[every.turn == 3].kv_entries.max() < once[once.turn == 3].kv_entries.min()


def _named(name):
    model = make_tiny_llama()
    model.config.name_or_path = name
    return model
