"""SCBench's multi-turn mode: one cache carried through every turn of a conversation, each turn's answer fed back.

    table = evaluate(datasets=["scbench"], tasks=["scbench_kv"], multi_turn=True, feeds=["model", "gold"],
                     compress=["once", "every-turn"], policies=["SnapKV"], ratios=[0.5])

The official run (microsoft/MInference fb56c91, scbench/run_scbench.py without --same_context_different_query, its
GreedySearch in eval_utils.py) keeps one cache per example over up to five turns:

- Turn 1 is the chat template around "{context text}\\n\\n{query}" (eval_utils.py:60-79 `multiturn_templates`,
  create_multiturn_prompt:465-470 for the generic tasks), the context text being what the lab's same-context mode
  already builds (evaluation.scbench.CONTEXTS). Turn t > 1 is a follow-up prompt appended to the same cache.
- Feed "gold" (the default, eval_utils.py:478-520): the follow-up renders [system "", assistant <the previous turn's
  reference answer>, user <query>] with the generation prompt and strips the rendering of [system ""] with the
  generation prompt, so it opens with the reference answer that continues the previous turn's "assistant" header.
  The model's own answer never enters the cache (GreedySearch._decode:1341-1366: decode steps go to a temporary
  cache, cleared after the turn).
- Feed "model" (--disable_golden_context): the follow-up is [user <query>] rendered with the generation prompt, the
  rendering of [system ""] without it stripped (a template that adds a default system turn, SmolLM2's, keeps it);
  the model's answer tokens stay in the cache as decoded (every token but the last one generated, which is never fed),
  and where the answer ran out of tokens instead of ending, its EOS opens the next prompt (_decode:1370-1372,
  _process_texts:1178-1181).
- Compression (minference/modules/kvcompression.py:212-262): the first prefill (context and first query) is
  compressed; every later token is appended uncompressed. That is compress="once" in the query-aware mode.

The lab adds what the field asks next (issue 56): compress="every-turn" compresses the live cache again before each
later question (compression.compressor.compress_again), the earlier turns' questions and answers included, back to
the token budget the first compression had (SCBench's SnapKV budget is a token count, max_capacity_prompt:
kvcompression.py:315); and the query-agnostic mode compresses what precedes each question (turn 1: the context; later
turns: the previous answer and the follow-up's opening up to the user's query), the query itself appended after.
The query-aware mode compresses each turn's prompt with its query.

A turn's prompt is fed in two parts: its lead (turn 1: the framed context; later: the model's answer tokens and
the follow-up's text up to the query) and its question (the query and the generation prompt; turn 1's opens with
the template's "\\n\\n"), each encoded on its own. Each turn decodes greedily on its own copy of the cache
(compression.generation.answer), so what enters the cache is what the feed mode says, whichever policy runs; a
policy that evicts while decoding (H2O) evicts on that copy, and the model's answer re-enters the cache as the next
turn's lead. Every turn is scored with SCBench's metric for the task (evaluation.metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from ..compression import SharedPrefill
from ..compression.compressor import again_refusal, compress_again
from ..compression.generation import answer
from ..compression.greedy import eos_cut, forward
from ..compression.state import applied
from ..core.framing import PLACEHOLDER, require_chat_template, resolve_framing
from ..core.inputs import check_context_length, eos_ids
from ..core.tokens import encode
from ..policies.base import FullCache
from .answer_rows import example_row, prediction, stop_ids
from .prompting import frame_texts
from .scbench import MAX_NEW_TOKENS

FEEDS = ("model", "gold")
COMPRESS = ("once", "every-turn")
# Tasks whose multi-turn prompts are the context text, "\n\n" and the query (create_multiturn_prompt's generic branch,
# qa_eng, qa_chn, choice_eng); scbench_mf (a prefix before the context) and scbench_summary (its own follow-up) are
# built otherwise there and are refused here.
TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_qa_eng", "scbench_qa_chn",
         "scbench_choice_eng", "scbench_many_shot", "scbench_summary_with_needles")


def check_multi_turn(datasets, tasks, feeds, compress, framing) -> None:
    """Refuse a multi-turn run of anything but SCBench's tasks above, or unknown feeds and compress options."""
    if list(datasets) != ["scbench"]:
        raise ValueError(f"multi-turn runs SCBench's conversations: --dataset scbench alone, got {list(datasets)}")
    refused = sorted(set(tasks or ()) - set(TASKS))
    if refused or not tasks:
        raise ValueError(f"multi-turn runs the tasks {', '.join(TASKS)} (name them with --tasks); "
                         f"{', '.join(refused) or 'none named'}: their multi-turn prompts are built otherwise")
    for name, given, allowed in (("feeds", feeds, FEEDS), ("compress", compress, COMPRESS)):
        if not given or set(given) - set(allowed):
            raise ValueError(f"{name} must be among {allowed}, got {list(given or ())}")
    if framing not in (None, "chat", "plain"):
        raise ValueError(f"multi-turn prompts are chat turns or plain text: framing must be chat or plain, got "
                         f"{framing!r}")


def follow_up(tokenizer, query: str, gold: str | None, chat: bool = True) -> tuple[str, str]:
    """(lead, question) texts of a later turn (module doc), split where the user's query starts. Chat:
    eval_utils.py:478-520 for gold, else the --disable_golden_context rendering. Plain (a model without a chat
    template, as the official script runs without --use_chat_template): `multiturn_follow_up_templates`
    "{pre_ans}\n\n{input}" for gold (eval_utils.py:117-134), the query alone for the model feed (eval_utils.py:454-455:
    `multiturn_follow_up_templates_in_chat_tempate`, "{input}")."""
    if not chat:
        return ("" if gold is None else gold + "\n\n"), query
    require_chat_template(tokenizer)

    def render(messages, generation):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    system = [{"role": "system", "content": ""}]
    user = [{"role": "user", "content": PLACEHOLDER}]
    if gold is None:
        text = render(user, True).replace(render(system, False), "")
    else:
        text = render([*system, {"role": "assistant", "content": gold}, *user], True).replace(render(system, True), "")
    if text.count(PLACEHOLDER) != 1:
        raise ValueError(f"the chat template does not copy a user message verbatim: {text!r}")
    lead, tail = text.split(PLACEHOLDER)
    return lead, query + tail


@dataclass(frozen=True)
class Turn:
    """One turn's ids: lead (fed before the question; a later turn's follows the model's own answer under the model
    feed), question, the answer's token limit."""

    lead: list[int]
    question: list[int]
    max_new_tokens: int


def conversation(tokenizer, example, feed: str, framing: str | None = None) -> list[Turn]:
    """The example's turns under `feed` (module doc), framed as chat turns where the tokenizer has a chat template
    (framing None) or as asked. The gold answer of a turn is its reference as the official rows hold it
    (example.meta["golds"])."""
    chat = resolve_framing(tokenizer, framing) == "chat"
    context, questions, _ = frame_texts(tokenizer, example, "chat" if chat else "plain")
    query_texts = [q.text for q in example.questions]
    kinds = example.meta.get("turn_tasks")  # a mixed set's per-turn generation lengths (eval_utils.py)
    limits = [MAX_NEW_TOKENS[example.task][kind] for kind in kinds] if kinds else [example.max_new_tokens] * len(
        query_texts)
    tail = questions[0][len(query_texts[0]):]  # the chat template's end of the user turn and generation prompt
    turns = [Turn(encode(tokenizer, context), encode(tokenizer, "\n\n" + query_texts[0] + tail), limits[0])]
    for index in range(1, len(query_texts)):
        gold = example.meta["golds"][index - 1] if feed == "gold" else None
        lead, question = follow_up(tokenizer, query_texts[index], gold, chat)
        turns.append(Turn(encode(tokenizer, lead), encode(tokenizer, question), limits[index]))
    return turns


def converse(model, tokenizer, shared: SharedPrefill, turns: list[Turn], policy, mode: str, feed: str,
             compress: str, texts: list[str], end_ids=(), min_new_tokens: int = 0):
    """Answer every turn of one conversation under `policy` in `mode` ("full" for the full cache), carrying one cache:
    yields (GenerationResult, whether the cache was compressed before this turn's answer) per turn. `shared`: the
    prefill of turn 1's lead (the context), its policies including `policy`."""
    as_ids = lambda ids: torch.tensor([ids], dtype=torch.long, device=model.device)  # noqa: E731
    ends = tuple(dict.fromkeys((*eos_ids(model, tokenizer), *end_ids)))
    aware = mode != "query-agnostic"
    first = (shared.extend(as_ids(turns[0].question)) if aware else shared).serving(policy)
    state, logits, n = first.state(policy), first.logits, first.n_tokens
    capacity = policy.budget(n)  # the first compression's budget in tokens: what every later one keeps
    fed = first.ids[0].tolist()
    carried: list[int] = []  # the model's answer tokens that enter the cache (the model feed)
    for index, turn in enumerate(turns):
        compressed = index == 0 and capacity is not None
        if index:
            lead = carried + turn.lead
            parts = [lead + turn.question] if aware else [lead, turn.question]
            again = compress == "every-turn" and capacity is not None and len(parts[0]) > 0
            for part_index, part in enumerate(parts):
                if not part:
                    continue
                if part_index == 0 and again:
                    logits = compress_again(model, state, as_ids(part), len(fed), capacity)
                else:
                    with applied(model, state):
                        logits = forward(model, as_ids(part), state.cache, len(fed))
                fed += part
            compressed = again
        elif not aware:  # turn 1's question after the compressed context
            with applied(model, state):
                logits = forward(model, as_ids(turn.question), state.cache, len(fed))
            fed += turn.question
        result = answer(model, tokenizer, state.fork(), logits, as_ids(fed), [texts[index]], [None],
                        prefill_seconds=shared.seconds, max_new_tokens=turn.max_new_tokens, mode=mode,
                        question_index=index, end_ids=end_ids, min_new_tokens=min_new_tokens)[0]
        if feed == "model":  # what the official decode left in the cache: every token but the last one generated,
            tokens = result.token_ids[0].tolist()  # and the EOS where the answer ran out of tokens instead of ending
            carried = tokens[:-1] + ([] if eos_cut(tokens, ends) < len(tokens) else [tokenizer.eos_token_id])
        yield result, compressed


def run_conversations(model, tokenizer, config: dict, prepared: tuple):
    """One cell of a multi-turn run: every feed x compress option x (full cache, and every policy x budget x mode),
    each conversation carrying its own cache over the example's turns; one row per turn (run.run_example's columns,
    with feed, compress, turn and recompressed). prepared: run.prepared_example's (example, encoded, {policy label:
    budget}, policies) of the cell."""
    example, _, budget_of, policies = prepared
    framing = resolve_framing(tokenizer, config["framing"])
    with torch.inference_mode():  # the states are built in inference mode: every feed over them must be too
        rows = _conversation_rows(model, tokenizer, config, example, budget_of, policies, framing)
    table = pd.DataFrame(rows)
    return table.astype({"ratio": "Float64", "capacity": "Int64", "length": "Int64"})


def _conversation_rows(model, tokenizer, config, example, budget_of, policies, framing) -> list[dict]:
    options, rows = config["multi_turn"], []
    stops = stop_ids(tokenizer, example)
    ends = (*eos_ids(model, tokenizer), *stops)
    texts = [q.text for q in example.questions]
    runs = [(FullCache(), "full")] + [(p, mode) for p in policies for mode in config["modes"]]
    for feed in options["feeds"]:
        turns = conversation(tokenizer, example, feed, config["framing"])
        check_context_length(model, sum(len(t.lead) + len(t.question) + t.max_new_tokens for t in turns),
                             what=f"{example.task} #{example.id}'s conversation")
        shared = SharedPrefill.run(model, tokenizer, torch.tensor([turns[0].lead], device=model.device), policies)
        for compress in options["compress"]:
            for policy, mode in runs:
                if mode == "full" and compress != options["compress"][0]:
                    continue  # the full cache compresses nothing: one conversation serves both options
                if mode != "full" and compress == "every-turn" and again_refusal(policy):
                    continue  # compress_again refuses it (AdaKV, KVzip): no rows, said in docs/multi-turn.md
                for result, again in converse(model, tokenizer, shared, turns, policy, mode, feed, compress, texts,
                                              stops, 1 if stops else 0):
                    budget = {"ratio": 0.0} if mode == "full" else budget_of[policy.label]
                    text = prediction(tokenizer, example, result, ends)
                    row = example_row(model, example, config, result, budget, text, len(turns[0].lead), 0,
                                      framing, shared.seconds)
                    rows.append(dict(row, feed=feed, compress="none" if mode == "full" else compress,
                                     turn=result.question_index + 1, recompressed=again))
    return rows

