"""Pressure tests on real text: needle in a haystack, and LongEval-Lines-style key/value retrieval.

Both are retrieval tasks: a context (chat header + haystack holding the facts) and one or more
questions about it. One prefill of each context serves every policy and budget:

    context prefill (full cache, scores of every policy recorded)  -> query-agnostic snapshots
    + question chunk (full cache, window scores recorded again)     -> query-aware snapshots
    each (policy, capacity, mode): compress a copy of the full cache from the stored scores, decode.

Query-aware: the question is part of the prompt, so SnapKV's window votes with the question.
Query-agnostic (kvpress's protocol): the context alone is compressed, the question appended after.
The full cache is the same in both modes. The prefill logits are the full cache's in every case
(as in the paper, the prompt is processed uncompressed), so the first answer token never differs.

Results are tidy tables (one row per question x policy x budget x mode) in data/pressure_*.csv;
`register` makes them part of `snapkv-lab figures`, and `snapkv-lab needle` runs them alone.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from .compression import (H2O, RandomKeep, ScoreRecorder, SnapKV, SnapKVNoPooling, StreamingLLM,
                          compressed_copy, decode_text, fork, greedy_decode)
from .chat import chat_frame
from .corpus import haystack_ids
from .figures import FigureSet, register, write_html
from .hooks import intercept_attention
from .inputs import check_context_length, eos_ids
from .timing import stopwatch
from .tokens import encode, token_span

# The chat template comes from the tokenizer (chat.chat_frame): the context is the template's head and
# the user's text; a question chunk is the question, the template's tail (end of the user turn and the
# assistant's generation prompt) and the answer's first words, so that the next token is the value.
NEEDLE = " One of the special magic numbers for {key} is: {value}. "
NEEDLE_QUESTION = "\n\nWhat is the special magic number for {key} mentioned in the provided text?"
NEEDLE_ANSWER = "The special magic number for {key} mentioned in the provided text is"
LINE = "line {key}: REGISTER_CONTENT is <{value}>\n"
LINES_HEAD = "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line index, memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve the corresponding <REGISTER_CONTENT> of a certain line index.\n\n"
LINES_QUESTION = "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {key}? I need the number."
LINES_ANSWER = "The <REGISTER_CONTENT> in line {key} is <"

DEFAULT_POLICIES = (SnapKV(), SnapKVNoPooling(), H2O(), StreamingLLM(), RandomKeep())
CAPACITIES = (256, 512, 1024, 2048)
MODES = ("query-aware", "query-agnostic")


@dataclass
class Query:
    """A question about a context: question_ids follow the context; `span` is the [start, end) token range
    of the fact in the context and `value_span` that of every token overlapping the answer's characters."""

    question_ids: list[int]
    answer: str
    span: tuple[int, int]
    value_span: tuple[int, int]
    meta: dict = field(default_factory=dict)


@dataclass
class Context:
    context_ids: list[int]
    queries: list[Query]
    meta: dict = field(default_factory=dict)


def _word_key(rng: random.Random) -> str:
    """RULER-style key: adjective-noun from wonderwords' lists."""
    if not hasattr(_word_key, "lists"):  # loading the lists takes ~0.15 s: once, not once per key
        from wonderwords import RandomWord

        words = RandomWord()
        _word_key.lists = (words.filter(include_categories=["adjectives"]), words.filter(include_categories=["nouns"]))
    adjectives, nouns = _word_key.lists
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def _fact(tokenizer, template: str, key: str, value: str) -> tuple[list[int], tuple[int, int]]:
    """A fact's token ids (tokenised on its own) and the [start, end) range of the tokens holding its value."""
    text = template.format(key=key, value=value)
    start = len(template.partition("{value}")[0].format(key=key))
    return token_span(tokenizer, text, start, start + len(value))


def _question(tokenizer, question: str, tail: str, answer: str, key: str) -> list[int]:
    """The question chunk: question, the chat template's tail, and the answer's first words."""
    return encode(tokenizer, question.format(key=key) + tail + answer.format(key=key))


def needle_context(tokenizer, n_tokens: int, depth: float, sample: int = 0) -> Context:
    """A haystack of Paul Graham essays of n_tokens in all (question included), with one 7-digit needle
    placed at `depth` (0 = first sentence, 1 = last), after a sentence end."""
    rng = random.Random(f"needle-{sample}")
    key, value = _word_key(rng), str(rng.randint(1_000_000, 9_999_999))
    chat_head, tail = chat_frame(tokenizer)
    head = encode(tokenizer, chat_head)
    needle, value_at = _fact(tokenizer, NEEDLE, key, value)
    question = _question(tokenizer, NEEDLE_QUESTION, tail, NEEDLE_ANSWER, key)
    room = n_tokens - len(head) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a needle context of {n_tokens} tokens leaves no room for a haystack: the chat template, "
                         f"needle and question alone take {n_tokens - room}")
    hay = haystack_ids(tokenizer, room, start=sample * 7)
    at = round(depth * len(hay))
    while 0 < at < len(hay) and "." not in tokenizer.decode(hay[at - 1: at]):
        at -= 1  # back to the previous sentence end, so the needle is a sentence of its own
    body = hay[:at] + needle + hay[at:]
    start = len(head) + at
    query = Query(question, value, (start, start + len(needle)), (start + value_at[0], start + value_at[1]),
                  dict(key=key, depth=depth, depth_position=start))
    return Context(head + body, [query], dict(task="needle", length=n_tokens, depth=depth, sample=sample))


def lines_context(tokenizer, n_tokens: int, n_queries: int = 8, sample: int = 0) -> Context:
    """LongEval-Lines-style record of `line <word-word>: REGISTER_CONTENT is <number>` lines filling n_tokens,
    with n_queries questions about lines spread evenly over the record."""
    rng = random.Random(f"lines-{sample}")
    chat_head, tail = chat_frame(tokenizer)
    head = encode(tokenizer, chat_head + LINES_HEAD)
    question_room = len(_question(tokenizer, LINES_QUESTION, tail, LINES_ANSWER, "wonderful-question"))
    body, facts, keys, longest_question = [], [], set(), 0
    while len(head) + len(body) < n_tokens - question_room - 30:
        key = _word_key(rng)
        if key in keys:
            continue
        keys.add(key)
        value = str(rng.randint(10_000, 99_999))
        line, value_at = _fact(tokenizer, LINE, key, value)
        # A tokenizer with short tokens makes lines longer than the 30 spare tokens: stop before the
        # record and any line's question pass n_tokens.
        longest_question = max(longest_question, len(_question(tokenizer, LINES_QUESTION, tail, LINES_ANSWER, key)))
        if len(head) + len(body) + len(line) + longest_question > n_tokens:
            break
        facts.append((key, value, len(head) + len(body), line, value_at))
        body += line
    if len(facts) < n_queries:
        raise ValueError(f"a lines record of {n_tokens} tokens holds {len(facts)} lines, fewer than {n_queries} queries")
    queries = []
    for i in range(n_queries):
        key, value, start, line, value_at = facts[round((i + 0.5) * len(facts) / n_queries)]
        queries.append(Query(_question(tokenizer, LINES_QUESTION, tail, LINES_ANSWER, key), value,
                             (start, start + len(line)), (start + value_at[0], start + value_at[1]),
                             dict(key=key, depth=start / (len(head) + len(body)), depth_position=start)))
    return Context(head + body, queries, dict(task="lines", length=n_tokens, lines=len(facts), sample=sample))


def _kept_fraction(kept: dict[int, torch.Tensor], span: tuple[int, int]) -> float:
    """Fraction of the span's positions kept, averaged over layers and KV heads."""
    start, end = span
    kept = list(kept.values())
    return float(sum(((k[0] >= start) & (k[0] < end)).sum() for k in kept)) / (len(kept) * kept[0].shape[1] * (end - start))


@torch.inference_mode()
def _prefill(model, ids: list[int], cache, recorder: ScoreRecorder, start: int):
    tensor = torch.tensor([ids], device=model.device)
    positions = torch.arange(start, start + len(ids), device=model.device)[None]
    with intercept_attention(model, recorder):
        return model(tensor, past_key_values=cache, position_ids=positions, use_cache=True,
                     logits_to_keep=1).logits[:, -1]


@torch.inference_mode()
def run_retrieval(model, tokenizer, contexts: list[Context], policies=DEFAULT_POLICIES, capacities=CAPACITIES,
                  modes=MODES, max_new_tokens: int = 24, progress: bool = True, on_context=None) -> pd.DataFrame:
    """Answer every query of every context with the full cache and each policy x capacity x mode.

    Returns a tidy table: one row per (context, query, policy, capacity, mode), with the answer text,
    correctness (the expected value appears in the answer), the fraction of the fact's and of the value's
    tokens kept (mean over layers and KV heads), the cache length and the decode time.
    on_context(rows_so_far) is called after each context (to save partial results).
    """
    for context in contexts:  # all of them before the first prefill, not an hour into the grid
        longest = max(len(q.question_ids) for q in context.queries)
        check_context_length(model, len(context.context_ids) + longest + max_new_tokens,
                             what=f"retrieval context {context.meta} with its question and {max_new_tokens} new tokens")
    policies = list(policies)
    kv_heads = model.config.num_key_value_heads
    eos = eos_ids(model, tokenizer)
    rows = []
    steps = sum(len(c.queries) for c in contexts) * (1 + len(policies) * len(capacities) * len(modes))
    bar = tqdm(total=steps, desc="retrieval", disable=not progress)
    for context in contexts:
        n_ctx = len(context.context_ids)
        recorder = ScoreRecorder(policies)
        context_cache = DynamicCache(config=model.config)
        with stopwatch(model.device) as prefill:
            _prefill(model, context.context_ids, context_cache, recorder, 0)
        context_scores = recorder.scores
        for query in context.queries:
            n = n_ctx + len(query.question_ids)
            aware = ScoreRecorder(policies)
            aware.scores = {name: dict(layers) for name, layers in context_scores.items()}  # H2O accumulates
            full = fork(context_cache)
            logits = _prefill(model, query.question_ids, full, aware, n_ctx)

            def answer(cache, first_logits, policy, capacity, mode, kept, uncompressed_length):
                tokens, seconds = greedy_decode(model, cache, first_logits, n, max_new_tokens, eos)
                text = decode_text(tokenizer, tokens, eos)[0]
                rows.append(dict(**context.meta, **{k: v for k, v in query.meta.items() if k not in context.meta},
                                 policy=policy, capacity=capacity, mode=mode, expected=query.answer, output=text,
                                 correct=query.answer in text,
                                 fact_kept=_kept_fraction(kept, query.span) if kept else 1.0,
                                 value_kept=_kept_fraction(kept, query.value_span) if kept else 1.0,
                                 cache_length=next(iter(kept.values())).shape[-1] if kept else uncompressed_length,
                                 prompt_tokens=n, prefill_s=prefill.seconds,
                                 decode_ms_per_token=1000 * sum(seconds) / max(1, len(seconds))))
                bar.update()

            answer(fork(full), logits, "FullCache", pd.NA, "full", None, n)
            for policy in policies:
                for capacity in capacities:
                    sized = dataclasses.replace(policy, capacity=capacity)
                    if "query-aware" in modes:
                        kept = _keep(sized, aware.scores, n, kv_heads)
                        cache = compressed_copy(full, kept) if kept else fork(full)
                        answer(cache, logits, policy.name, capacity, "query-aware", kept, n)
                    if "query-agnostic" in modes:
                        kept = _keep(sized, context_scores, n_ctx, kv_heads)
                        cache = compressed_copy(context_cache, kept) if kept else fork(context_cache)
                        first = _prefill(model, query.question_ids, cache, ScoreRecorder([]), n_ctx)
                        answer(cache, first, policy.name, capacity, "query-agnostic", kept, n_ctx)
        if on_context is not None:
            on_context(pd.DataFrame(rows))
    bar.close()
    return pd.DataFrame(rows)


def _keep(policy, scores: dict, n: int, kv_heads: int) -> dict[int, torch.Tensor] | None:
    """{layer: kept positions (1, kv_heads, budget)} for every scored (full-attention) layer, or None if the
    prompt fits."""
    if policy.budget(n) is None:
        return None
    return {i: policy.keep(layer_scores[0], n, kv_heads)[None] for i, layer_scores in sorted(scores[policy.name].items())}


# ---- figure set -------------------------------------------------------------------------------------------

NEEDLE_LENGTHS = (2000, 4000, 7500)
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_SAMPLES = 3  # haystacks per (length, depth): the committed grid
LINES_SAMPLES = 1


def recompute(options: dict) -> None:
    """Run the needle grid and the lines ablation, writing data/pressure_needle.csv and data/pressure_lines.csv."""
    from .models import load_model

    data_dir = Path(options.get("data_dir", "data"))
    data_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(options.get("model"))
    lengths = options.get("lengths") or NEEDLE_LENGTHS
    depths = options.get("depths") or NEEDLE_DEPTHS
    # Samples differ in needle (key, value) and haystack start; first_sample lets a long grid run in pieces.
    first = options.get("first_sample") or 0
    samples = range(first, first + (options.get("samples") or NEEDLE_SAMPLES))
    contexts = [needle_context(tokenizer, n, d, s) for n in lengths for d in depths for s in samples]
    save = lambda name: (lambda table: table.to_csv(data_dir / name, index=False))  # noqa: E731
    save("pressure_needle.csv")(run_retrieval(model, tokenizer, contexts, on_context=save("pressure_needle.csv")))
    if not options.get("skip_lines"):
        lines = [lines_context(tokenizer, n, n_queries=options.get("line_queries") or 8, sample=s)
                 for n in options.get("lines_lengths") or (2000,) for s in range(first, first + LINES_SAMPLES)]
        table = run_retrieval(model, tokenizer, lines, policies=(SnapKV(), SnapKVNoPooling()),
                              capacities=(256, 512, 1024), modes=("query-aware",), on_context=save("pressure_lines.csv"))
        save("pressure_lines.csv")(table)


def accuracy_table(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy by mode, policy and capacity (rows) and prompt length (columns), the full cache on top."""
    table = table.copy()
    full = table[table.policy == "FullCache"]
    expanded = pd.concat([full.assign(mode=m) for m in MODES if m in set(table["mode"])] + [table[table.policy != "FullCache"]])
    expanded["budget"] = expanded.capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
    return expanded.pivot_table(index=["mode", "policy", "budget"], columns="length", values="correct", aggfunc="mean")


def draw(data_dir: Path, figures_dir: Path) -> list[Path]:
    """Heatmaps (depth x length) per policy and budget for each mode, accuracy-vs-budget lines, lines ablation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import plotly.express as px

    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    written = []
    needle_path = data_dir / "pressure_needle.csv"
    if needle_path.exists():
        table = pd.read_csv(needle_path)
        table["budget"] = table.capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
        for mode in MODES:
            part = pd.concat([table[table.policy == "FullCache"], table[table["mode"] == mode]])
            policies = [p for p in part.policy.unique() if p != "FullCache"]
            budgets = [b for b in part.budget.unique() if b != "full"]
            cells = part.groupby(["policy", "budget", "depth", "length"], as_index=False).correct.mean()
            fig, axes = plt.subplots(len(policies) + 1, len(budgets), figsize=(2.6 * len(budgets), 2.2 * (len(policies) + 1)),
                                     squeeze=False, sharex=True, sharey=True)
            for r, policy in enumerate(["FullCache", *policies]):
                for c, budget in enumerate(budgets):
                    ax = axes[r, c]
                    sel = cells[(cells.policy == policy) & (cells.budget == ("full" if policy == "FullCache" else budget))]
                    grid = sel.pivot(index="depth", columns="length", values="correct")
                    ax.imshow(grid.values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                    ax.set_xticks(range(len(grid.columns)), [str(x) for x in grid.columns])
                    ax.set_yticks(range(len(grid.index)), [f"{d:.0%}" for d in grid.index])
                    ax.set_title(f"{policy} ({'full' if policy == 'FullCache' else budget})", fontsize=8)
            fig.supxlabel("prompt length (tokens)")
            fig.supylabel("needle depth")
            fig.suptitle(f"Needle retrieval, SmolLM2-135M, {mode} (green = found)")
            fig.tight_layout()
            png = figures_dir / f"pressure_needle_{mode}.png"
            fig.savefig(png, dpi=110)
            plt.close(fig)
            interactive = px.density_heatmap(cells[cells.policy != "FullCache"], x="length", y="depth", z="correct",
                                             facet_row="policy", facet_col="budget", histfunc="avg", range_color=(0, 1),
                                             color_continuous_scale="RdYlGn", title=f"Needle retrieval, {mode}",
                                             category_orders={"budget": budgets})
            written += [png, write_html(interactive, figures_dir / f"pressure_needle_{mode}.html")]
        summary = accuracy_table(table).stack().rename("accuracy").reset_index()
        summary = summary[summary.policy != "FullCache"].assign(budget=lambda d: d.budget.astype(int))
        full = table[table.policy == "FullCache"].groupby("length").correct.mean()
        fig = px.line(summary, x="budget", y="accuracy", color="policy", facet_col="length", facet_row="mode", markers=True,
                      log_x=True, title="Needle accuracy vs KV budget (dotted: full cache)")
        for i, length in enumerate(sorted(full.index)):
            for row in (1, 2):
                fig.add_hline(y=full[length], line_dash="dot", row=row, col=i + 1)
        html = write_html(fig, figures_dir / "pressure_needle_budget.html")
        png = figures_dir / "pressure_needle_budget.png"
        _budget_png(summary, full, png)
        written += [png, html]
    lines_path = data_dir / "pressure_lines.csv"
    if lines_path.exists():
        lines = pd.read_csv(lines_path)
        lines["budget"] = lines.capacity.map(lambda c: "full" if pd.isna(c) else str(int(c)))
        acc = lines.groupby(["policy", "budget"], as_index=False).agg(accuracy=("correct", "mean"), value_kept=("value_kept", "mean"))
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for policy, part in acc[acc.policy != "FullCache"].groupby("policy"):
            part = part.assign(b=part.budget.astype(int)).sort_values("b")
            ax.plot(part.b, part.accuracy, marker="o", label=policy)
        ax.axhline(acc[acc.policy == "FullCache"].accuracy.mean(), ls=":", color="k", label="FullCache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (tokens)")
        ax.set_ylabel("accuracy")
        ax.set_title("LongEval-Lines-style retrieval: pooling ablation")
        ax.legend(fontsize=8)
        fig.tight_layout()
        png = figures_dir / "pressure_lines.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        bars = px.bar(acc, x="budget", y="accuracy", color="policy", barmode="group", hover_data=["value_kept"],
                      title="Lines retrieval: SnapKV with and without pooling")
        written += [png, write_html(bars, figures_dir / "pressure_lines.html")]
    return written


def _budget_png(summary: pd.DataFrame, full: pd.Series, path: Path) -> None:
    import matplotlib.pyplot as plt

    modes, lengths = sorted(summary["mode"].unique()), sorted(summary.length.unique())
    fig, axes = plt.subplots(len(modes), len(lengths), figsize=(3.4 * len(lengths), 2.8 * len(modes)), squeeze=False,
                             sharex=True, sharey=True)
    for r, mode in enumerate(modes):
        for c, length in enumerate(lengths):
            ax = axes[r, c]
            part = summary[(summary["mode"] == mode) & (summary.length == length)]
            for policy, line in part.groupby("policy"):
                line = line.sort_values("budget")
                ax.plot(line.budget, line.accuracy, marker="o", label=policy)
            ax.axhline(full[length], ls=":", color="k", label="FullCache")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, {length} tokens", fontsize=9)
    axes[0, -1].legend(fontsize=7)
    fig.supxlabel("KV budget (tokens per head)")
    fig.supylabel("needle accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


register(FigureSet(name="pressure", recompute=recompute, draw=draw, recompute_by_default=False))
