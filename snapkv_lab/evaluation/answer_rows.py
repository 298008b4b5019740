"""One answer of an eval run as a row of its table: the prediction as the official scorer reads it, its score by the
task's metric, and the row's columns (evaluation.run's module doc). Shared by single-turn cells (evaluation.run) and
multi-turn conversations (evaluation.multiturn)."""

from __future__ import annotations

import json

from ..core.timing import ms_per_token
from ..core.tokens import encode
from ..policies import policy_config
from ..tasks.corpus import redact_essays
from .examples import Example, Question


def example_row(model, example: Example, config: dict, run, budget: dict, text: str, context_tokens: int,
                truncated: int, framing: str, prefill_seconds: float) -> dict:
    """One answer's row of an eval table (`evaluate`'s columns): `run` a GenerationResult, `text` its prediction as
    the scorer reads it, budget {"ratio": r} or {"capacity": c}."""
    question = example.questions[run.question_index]
    return dict(
        model=model.config.name_or_path, dataset=example.dataset, task=example.task, example=example.id,
        spec=json.dumps(config["example"], sort_keys=True), policy_config=json.dumps(policy_config(run.policy)),
        question=run.question_index, metric=question.metric or example.metric, policy=run.policy.scorer_label,
        ratio=budget.get("ratio"), capacity=budget.get("capacity"), mode=run.mode,
        score=score_answer(example, question, text), prediction=redact_essays(text),
        references=json.dumps(list(question.answers), ensure_ascii=False),
        context_tokens=context_tokens, prompt_tokens=run.prompt_tokens,
        kept_tokens=max(run.cache_lengths), **run.entries.columns(),
        layer_kv_share=json.dumps([round(share, 5) for share in run.entries.layer_shares()[0]]),
        truncated_tokens=truncated, framing=framing, length=example.meta.get("length"),
        prefill_s=prefill_seconds, selection_s=run.selection_seconds,
        decode_ms_per_token=ms_per_token(run.step_seconds), new_tokens=run.token_ids.shape[1])


def stop_ids(tokenizer, example: Example) -> list[int]:
    """The tokens that also end the example's answers, after at least one (min_new_tokens=1): pred.py's samsum call,
    eos_token_id=[eos, the last token of "\\n"] with min_length one past the prompt."""
    return [encode(tokenizer, text)[-1] for text in example.stop]


def prediction(tokenizer, example: Example, run, ends) -> str:
    """The answer as the official scorer reads it: as LongBench's pred.py decodes it (line 91: every new token, special
    ones skipped, not stripped) where Example.raw_prediction, else stripped (the engine's run.text)."""
    if not example.raw_prediction:
        return run.text
    tokens = run.token_ids[0].tolist()
    cut = next((i + 1 for i, token in enumerate(tokens) if token in ends), len(tokens))  # the ending token kept
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True)


def score_answer(example: Example, question: Question, prediction: str) -> float:
    """The official metric (evaluation.metrics) of one prediction against the question's references, in [0, 1]:
    the question's own metric, else the example's."""
    from .metrics import score

    return score(question.metric or example.metric, prediction, list(question.answers), task=example.task,
                 **example.meta)
