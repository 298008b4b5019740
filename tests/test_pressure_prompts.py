"""Needle and lines prompts for any chat model: the tokenizer's own template, exact value spans when a
tokenizer merges digits, and clear errors for a missing template or a prompt longer than the model's context."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from conftest import ByteTokenizer, make_tiny_llama
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from snapkv_lab.core.framing import chat_frame
from snapkv_lab.core.inputs import check_context_length, encode_prompt
from snapkv_lab.core.models import bundled_checkpoint
from snapkv_lab.core.tokens import decoded_offsets, token_span
from snapkv_lab.pressure import Context, Query, lines_context, needle_context, run_retrieval
from snapkv_lab.tasks.haystacks import HAYSTACKS, boundary

SMOLLM_HEAD = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\n")
SMOLLM_TAIL = "<|im_end|>\n<|im_start|>assistant\n"
DIGITS_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                   "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
DIGITS_HEAD, DIGITS_TAIL = "<s>user\n", "</s>\n<s>assistant\n"


def digit_merging_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on Python docs and random numbers: it merges digits and a leading space
    (" 51", "23", "456"), as GPT-2 or Llama-3 tokenizers do, unlike SmolLM2's one token per digit."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    numbers = [" ".join(str(rng.randint(0, 10**7)) for _ in range(50)) for _ in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text for _, text in sorted(topics.items())][:30] + numbers, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                        chat_template=DIGITS_TEMPLATE)
    tokenizer.name_or_path = "tiny-digit-merging-bpe"
    return tokenizer


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return AutoTokenizer.from_pretrained(bundled_checkpoint())


@pytest.fixture(scope="module")
def digits_tokenizer():
    return digit_merging_tokenizer()


@pytest.fixture(params=["smollm", "digits"])
def case(request, smollm_tokenizer, digits_tokenizer):
    """(tokenizer, the template's head and tail, written out by hand)."""
    if request.param == "smollm":
        return smollm_tokenizer, SMOLLM_HEAD, SMOLLM_TAIL
    return digits_tokenizer, DIGITS_HEAD, DIGITS_TAIL


def assert_minimal_span(tokenizer, ids, span, value):
    start, end = span
    assert value in tokenizer.decode(ids[start:end])
    assert value not in tokenizer.decode(ids[start + 1:end])
    assert value not in tokenizer.decode(ids[start:end - 1])


def test_the_digit_tokenizer_merges_digits_so_searching_value_tokens_fails(digits_tokenizer):
    # Precondition of the tests below: the value tokenised alone is not a sub-list of the fact's tokens.
    text = " One of the special magic numbers for red-fox is: 5123456. "
    fact = digits_tokenizer(text, add_special_tokens=False)["input_ids"]
    alone = digits_tokenizer("5123456", add_special_tokens=False)["input_ids"]
    assert not any(fact[i:i + len(alone)] == alone for i in range(len(fact)))
    ids, (start, end) = token_span(digits_tokenizer, text, text.index("5123456"), text.index("5123456") + 7)
    pieces = [digits_tokenizer.decode([i]) for i in ids[start:end]]
    assert "".join(pieces).strip() == "5123456" and pieces[0].startswith(" ") and len(pieces) < 7


def test_token_span_by_decoding_matches_hand_computed_offsets(digits_tokenizer):
    # One token per byte: the value's characters are its tokens.
    ids, span = token_span(ByteTokenizer(), "is: 5123456. ", 4, 11)
    assert span == (4, 11) and len(ids) == 13

    class LeadingSpaceDropped(ByteTokenizer):  # decodes like SentencePiece: the first space is lost
        def decode(self, ids, skip_special_tokens=False):
            return super().decode(ids).lstrip(" ")

    text = " 12 34"
    offsets = decoded_offsets(LeadingSpaceDropped(), list(text.encode()), text)
    assert offsets == [(1, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert token_span(LeadingSpaceDropped(), text, 4, 6)[1] == (4, 6)
    # Decoding and the fast tokenizer's own offsets agree on a merging tokenizer.
    text = "line calm-river: REGISTER_CONTENT is <48213>\n"
    encoded = digits_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert (decoded_offsets(digits_tokenizer, encoded["input_ids"], text)
            == [tuple(o) for o in encoded["offset_mapping"]])
    with pytest.raises(ValueError, match="non-empty range"):
        token_span(digits_tokenizer, text, 5, 5)


def test_chat_frame_is_the_tokenizers_own_template(case):
    tokenizer, head, tail = case
    assert chat_frame(tokenizer) == (head, tail)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_context_in_any_template(case, depth):
    tokenizer, head, tail = case
    ctx = needle_context(tokenizer, 600, depth, sample=1)
    query, ids = ctx.queries[0], ctx.context_ids
    key = query.meta["key"]
    assert len(ids) + len(query.question_ids) == 600
    assert tokenizer.decode(ids).startswith(head)
    start, end = query.span
    assert tokenizer.decode(ids[start:end]) == f" One of the special magic numbers for {key} is: {query.answer}. "
    assert len(query.answer) == 7 and query.answer.isdigit()
    assert_minimal_span(tokenizer, ids, query.value_span, query.answer)
    assert query.span[0] < query.value_span[0] < query.value_span[1] <= query.span[1]
    assert tokenizer.decode(query.question_ids) == (
        f"\n\nWhat is the special magic number for {key} mentioned in the provided text?{tail}"
        f"The special magic number for {key} mentioned in the provided text is")
    head_len = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    hay = len(ids) - head_len - (end - start)
    if depth == 0.0:
        assert start == head_len
    elif depth == 1.0:
        assert end == len(ids)
    else:  # at the middle of the haystack, walked back over the tokens of one sentence to its end
        walked = round(depth * hay) - (start - head_len)
        assert 0 <= walked < 0.2 * hay
        assert not any("." in tokenizer.decode([i]) for i in ids[end:end + walked])
        assert "." in tokenizer.decode(ids[start - 1:start])


def test_lines_context_in_any_template(case):
    tokenizer, head, tail = case
    ctx = lines_context(tokenizer, 700, n_queries=4, sample=0)
    ids = ctx.context_ids
    assert tokenizer.decode(ids).startswith(head + "Below is a record of lines")
    assert len(ctx.queries) == 4 and ctx.meta["lines"] > 4
    for query in ctx.queries:
        key, value = query.meta["key"], query.answer
        assert tokenizer.decode(ids[query.span[0]:query.span[1]]) == f"line {key}: REGISTER_CONTENT is <{value}>\n"
        assert_minimal_span(tokenizer, ids, query.value_span, value)
        assert tokenizer.decode(query.question_ids).endswith(f"I need the number.{tail}The <REGISTER_CONTENT> in line "
                                                             f"{key} is <")
    assert max(len(ids) + len(q.question_ids) for q in ctx.queries) <= 700


def test_a_tokenizer_without_chat_template_gets_plain_text_framing(digits_tokenizer):
    """A base model's prompts: the context, then "Question: ..." and "Answer:" with the answer's opening words;
    spans as exact as in a chat template. Chat framing asked of it is refused, naming the model."""
    plain = digit_merging_tokenizer()
    plain.chat_template = None
    ctx = needle_context(plain, 600, 0.5, sample=1)
    query, key = ctx.queries[0], ctx.queries[0].meta["key"]
    assert len(ctx.context_ids) + len(query.question_ids) == 600
    assert plain.decode(query.question_ids) == (f"\n\nQuestion: What is the special magic number for {key} mentioned "
                                                f"in the provided text?\nAnswer: The special magic number for {key} "
                                                "mentioned in the provided text is")
    assert plain.decode(ctx.context_ids[query.span[0]:query.span[1]]).startswith(" One of the special magic numbers")
    assert_minimal_span(plain, ctx.context_ids, query.value_span, query.answer)
    lines = lines_context(plain, 700, n_queries=2)
    assert plain.decode(lines.context_ids).startswith("Below is a record of lines")
    assert plain.decode(lines.queries[0].question_ids).startswith("\nQuestion: Now the record is over.")
    for build in (lambda: needle_context(plain, 600, 0.5, framing="chat"),
                  lambda: lines_context(plain, 700, framing="chat")):
        with pytest.raises(ValueError, match="'tiny-digit-merging-bpe' has no chat template.*framing='plain'"):
            build()
    assert plain.decode(encode_prompt(plain, [{"role": "user", "content": "Hello"}])[0]) == "Hello\nAnswer:"
    ids = encode_prompt(digits_tokenizer, [{"role": "user", "content": "Hello"}])
    assert digits_tokenizer.decode(ids[0]) == DIGITS_HEAD + "Hello" + DIGITS_TAIL
    # A chat model can be framed as plain text too, on request.
    forced = needle_context(digits_tokenizer, 600, 0.5, sample=1, framing="plain")
    assert (forced.queries[0].question_ids == query.question_ids
            and not digits_tokenizer.decode(forced.context_ids).startswith(DIGITS_HEAD))
    with pytest.raises(ValueError, match="no room for a haystack"):
        needle_context(digits_tokenizer, 30, 0.5)


def test_cli_chat_framing_of_a_template_less_model_fails_before_running(tmp_path, capsys):
    from snapkv_lab.app.cli import main

    folder = tmp_path / "plain-model"
    make_tiny_llama().save_pretrained(folder)
    plain = digit_merging_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(folder)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompt_recipes.json").write_text(open("data/prompt_recipes.json").read())
    common = ["--model", str(folder), "--data-dir", str(tmp_path / "data"), "--figures-dir", str(tmp_path / "figures"),
              "--framing", "chat"]
    with pytest.raises(ValueError, match=f"{folder}' has no chat template"):
        main(["needle", *common])
    # figures says a refused option on stderr with exit status 2, as argparse does
    assert main(["figures", "--recompute", "--only", "findings", *common]) == 2
    assert f"{folder}' has no chat template" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["prompt_recipes.json"]


def test_check_context_length_limits():
    config = LlamaConfig(max_position_embeddings=100)
    check_context_length(config, 100)
    with pytest.raises(ValueError,
                       match=r"needle context needs 101 positions.*at most 100 \(config.max_position_embeddings\)"):
        check_context_length(config, 101, what="needle context")
    model = make_tiny_llama(max_position_embeddings=64)
    with pytest.raises(ValueError, match="at most 64"):
        check_context_length(model, 65)
    check_context_length(SimpleNamespace(), 10**9)  # no limit known: nothing to check


def test_run_retrieval_refuses_a_context_longer_than_the_model_before_any_prefill(byte_tokenizer):
    model = make_tiny_llama(max_position_embeddings=64)

    def no_run(*args, **kwargs):
        raise AssertionError("the model ran")

    model.forward = no_run
    context = Context(list(range(40)),
                      [Query(list(range(10)), "7", (0, 5), (1, 2)), Query(list(range(20)), "7", (0, 5), (1, 2))])
    with pytest.raises(ValueError, match="needs 65 positions"):  # 40 context + 20 longest question + 5 new
        run_retrieval(model, byte_tokenizer, [context], max_new_tokens=5, progress=False)


def test_run_findings_refuses_prompts_longer_than_the_model(smollm_tokenizer, tmp_path):
    from snapkv_lab.findings.experiments import run_findings

    (tmp_path / "prompt_recipes.json").write_text(open("data/prompt_recipes.json").read())
    model = make_tiny_llama(max_position_embeddings=1024)  # the chat prompts are over 3k tokens
    with pytest.raises(ValueError, match="prompt chat-dev-0 with 256 new tokens needs .* at most 1024"):
        run_findings(model, smollm_tokenizer, data_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompt_recipes.json"]


def test_ruler_and_strict_grades():
    from snapkv_lab.pressure import found, found_exactly

    assert found("9935848", "99358488888888") and not found_exactly("9935848", "99358488888888")
    assert found_exactly("9935848", "The number is 9935848.") and found_exactly("9935848", "9935848")
    assert not found_exactly("9935848", "19935848 is it") and not found("9935848", "993584")
    assert found_exactly("a1b2-c3", "code: a1b2-c3!") and not found_exactly("a1b2-c3", "code: a1b2-c3x")


@pytest.mark.parametrize("task", ["single", "multikey", "multivalue", "multiquery"])
@pytest.mark.parametrize("kind", ["number", "word", "uuid"])
def test_ruler_contexts_hold_their_needles(task, kind, case):
    from snapkv_lab.pressure import ruler_context

    tokenizer = case[0]
    ctx = ruler_context(tokenizer, 1200, task=task, value_kind=kind, needles=3, sample=1)
    longest = max(len(q.question_ids) for q in ctx.queries)
    assert len(ctx.context_ids) + longest <= 1200
    assert len(ctx.queries) == (3 if task == "multiquery" else 1)
    text = tokenizer.decode(ctx.context_ids)
    needles = text.count("One of the special magic")
    assert needles == (1 if task == "single" else 3)
    for query in ctx.queries:
        values = query.answer if isinstance(query.answer, list) else [query.answer]
        assert len(values) == (3 if task == "multivalue" else 1)
        assert all(text.count(value) == 1 for value in values)  # each value stated once, by its own needle
        assert_minimal_span(tokenizer, ctx.context_ids, query.value_span, values[0])
        assert query.meta["key"] in tokenizer.decode(query.question_ids)
        start, end = query.span
        assert tokenizer.decode(ctx.context_ids[start:end]).strip().startswith("One of the special magic")
    if task in ("multikey", "multiquery"):
        assert len({q.meta["key"] for q in ctx.queries}) == len(ctx.queries)
        assert text.count(ctx.queries[0].meta["key"]) == 1  # the distractors have other keys


def test_ruler_grading_wants_every_value():
    from snapkv_lab.pressure import found, found_exactly

    assert found(["cat", "dog"], "a dog and a cat") and not found(["cat", "dog"], "a cat")
    assert not found_exactly(["cat", "dog"], "a cats and dogs") and found_exactly(["cat", "dog"], "cat, dog.")


@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("depth", [0.0, 0.6, 1.0])
def test_needle_in_every_kind_of_haystack(case, haystack, depth):
    """Each kind's needle, whole and on a line (a sentence) of its own, with an exact value span; the haystack is of
    its kind (stdlib source, log lines holding ids, key lines of the needle's own form)."""
    tokenizer, head, _ = case
    ctx = needle_context(tokenizer, 800, depth, sample=2, haystack=haystack)
    query, ids = ctx.queries[0], ctx.context_ids
    key, value = query.meta["key"], query.answer
    assert len(ids) + len(query.question_ids) == 800 and ctx.meta["haystack"] == haystack
    start, end = query.span
    needle = tokenizer.decode(ids[start:end])
    assert f"{key}" in needle and needle.rstrip().endswith((f"{value}", f"{value}.")) and needle.count(value) == 1
    assert_minimal_span(tokenizer, ids, query.value_span, value)
    if depth == 0.0:
        assert start == len(tokenizer(head, add_special_tokens=False)["input_ids"])
    elif depth == 1.0:
        assert end == len(ids)
    else:  # after a sentence end in prose, a line end elsewhere
        assert boundary(haystack) in tokenizer.decode(ids[start - 1:start])
    text = tokenizer.decode(ids)
    if haystack == "code":
        assert "def " in text and "return" in text and needle.startswith(f'special_magic_numbers["{key}"] = ')
    if haystack == "logs":
        assert text.count(" request ") > 5 and "status" in text and "registry[" in needle
    if haystack == "keys":  # distractors have the needle's form, with other keys and values
        assert text.count("magic number for ") > 15 and needle == f"magic number for {key}: {value}\n"


def test_unknown_haystack_is_refused(digits_tokenizer):
    with pytest.raises(ValueError, match="haystack must be one of"):
        needle_context(digits_tokenizer, 600, 0.5, haystack="tweets")
