"""benchmarks/kvpress_side_by_side.py --timing without the kvpress venv: its arguments, the rows it times, the
prompt it builds (kvpress's tokenising, fitted to the model's positions), the lab's half of one run, and the guard
that redoes a run other processes disturbed. The timing itself (both sides) is the script's, not a test's."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kvpress_side_by_side as sbs  # noqa: E402
from kvpress_peer import build, kvpress_style_ids, n_kept  # noqa: E402


def test_timing_defaults():
    args = sbs.parse_args(["--timing"])
    assert ((args.lengths, args.repeats, args.questions, args.new_tokens, args.ratio)
            == ([2048, 4096, 8192], 3, 4, 16, 0.75))
    assert args.only == ["SnapKV", "ExpectedAttention", "KVzip", "AdaKV(SnapKV)", "StreamingLLM"]


def test_timing_rows_are_peer_rows():
    """Each timed row is a kept-positions row (its policy and press), by its timing label or its own."""
    assert sbs.timing_row("AdaKV(SnapKV)") is sbs.timing_row("AdaKV")
    for label in sbs.TIMING_ROWS:
        row = sbs.timing_row(label)
        assert build(row.ours, 512).capacity == 512
        assert row.press.format(ratio=0.75)
    args = sbs.parse_args(["--timing", "--only", "KVzip", "AdaKV", "--lengths", "1024"])
    assert [sbs.timing_row(label).label for label in args.only] == ["KVzip", "AdaKV"]


@pytest.mark.parametrize("argv", [["--timing", "--only", "H2O-ish"], ["--timing", "--repeats", "0"],
                                  ["--timing", "--questions", "99"]])
def test_timing_refuses(argv, capsys):
    with pytest.raises(SystemExit):
        sbs.parse_args(argv)


@pytest.mark.slow
def test_prompt_is_kvpress_pipeline_shaped(smollm):
    """Context ids: the chat template's head, then the text; question ids: the question, then the template's tail
    (kvpress/pipeline.py preprocess); fitted to the length asked and to the model's positions."""
    model, tokenizer = smollm
    questions = list(sbs.QUESTIONS[:2])
    text, ids, question_ids = sbs.fitted_context(tokenizer, 700, questions, 16, model.config.max_position_embeddings)
    assert 690 <= len(ids) <= 700
    assert tokenizer.decode(ids).startswith("<|im_start|>system") and tokenizer.decode(ids).endswith(text)
    assert tokenizer.decode(question_ids[0]) == questions[0] + "<|im_end|>\n<|im_start|>assistant\n"
    assert (ids, question_ids) == kvpress_style_ids(tokenizer, text, questions)
    limit = 1000
    _, ids, question_ids = sbs.fitted_context(tokenizer, 4000, questions, 16, limit)
    assert len(ids) + max(map(len, question_ids)) + 16 <= limit


@pytest.mark.slow
def test_lab_call_answers_every_question(smollm):
    model, tokenizer = smollm
    questions = list(sbs.QUESTIONS[:2])
    text, ids, _ = sbs.fitted_context(tokenizer, 300, questions, 3, model.config.max_position_embeddings)
    policy = build(sbs.timing_row("SnapKV").ours, n_kept(len(ids), 0.75))
    answers = sbs.lab_call(model, tokenizer, policy, text, questions, 3)
    assert len(answers) == 2 and all(isinstance(answer, str) for answer in answers)


def test_quiet_run_redoes_a_disturbed_run():
    class FakeQuiet:
        shares = [0.0, 0.5, 0.0, 0.01]  # wait, the first run (disturbed), wait, the second run

        def wait(self, threshold, patience):
            return self.shares.pop(0)

        def start(self):
            pass

        def others(self):
            return self.shares.pop(0)

    runs = []
    seconds, out, share, redone = sbs.quiet_run(FakeQuiet(), lambda: runs.append(1) or len(runs), 0.05, 4)
    assert (out, share, redone) == (2, 0.01, 1) and seconds >= 0


def test_quiet_reads_this_machine():
    import os

    quiet = sbs.Quiet([os.getpid()])
    quiet.start()
    deadline = time.perf_counter() + 0.3  # busy for many ticks of /proc's 10 ms clock
    while time.perf_counter() < deadline:
        pass
    assert 0.0 <= quiet.others() <= 1.0
    assert quiet._busy()[1] > 0  # our own CPU time is read, and left out of the share
