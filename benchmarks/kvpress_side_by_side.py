"""Side by side with NVIDIA kvpress 0.5.5: which prompt positions each of our policies keeps, next to what the
matching kvpress press keeps, layer by layer and KV head by KV head, on the bundled SmolLM2-135M-Instruct.

    bash scripts/kvpress_venv.sh                      # once (cached): kvpress in its own venv
    python3 benchmarks/kvpress_side_by_side.py        # --tokens 1000 --ratio 0.75 by default

The rows, both halves and the comparison are benchmarks/kvpress_peer.py's, which tests/test_peer.py
(`pytest -m peer`) asserts on; this script prints and saves the whole table, pending rows included.
Output: a markdown table on stdout, benchmarks/results/kvpress_side_by_side.{csv,md} and the per-layer detail
in kvpress_side_by_side_layers.csv.

    python3 benchmarks/kvpress_side_by_side.py --timing  # --lengths 2048 4096 8192 --repeats 3 --questions 4

--timing: wall time of the same work on both sides, kvpress's query-agnostic protocol: one context compressed
once, then several questions, each fed over the compressed cache and answered greedily. kvpress runs its own
pipeline, `pipeline("kv-press-text-generation")(context, questions=[...], press=..., max_new_tokens=N)`, in a
long-lived worker in its venv (benchmarks/_kvpress_worker.py --serve); the lab runs
`snapkv_lab.generate(model, tokenizer, context_ids, policy=..., question=[ids, ...], max_new_tokens=N)` here on the
ids kvpress's preprocessing makes of the same texts (kvpress_peer.kvpress_style_ids; checked equal to the
worker's own before any timing). Both timed calls include that tokenising; budgets as in the kept-positions table
(capacity = kvpress's n_kept); EOS ignored on both sides so every answer has N tokens; the same threads, fp32, sdpa,
one model load per side. The two alternate (lab first on even (repeat + row), kvpress first on odd), one run at a
time, after one untimed warm-up per row and side on a short context. Reported: medians and every repeat, the
ratio lab / kvpress, each side's CPU seconds (median; every thread of its process), and the fraction of answers
whose greedy text is identical on both sides. --context-file and
--question time other prompts (a held-out check). Output: benchmarks/results/kvpress_timing.{csv,md}.

Columns: jaccard = |ours & theirs| / |ours | theirs| of the kept position sets of one layer and KV head;
jaccard_mean over every (layer, KV head); jaccard_min_layer the worst layer's mean over its KV heads;
identical_layers the fraction of layers whose sets are equal in every KV head; kept_ours / kept_theirs the
positions kept per KV head (mean; min-max when budgets vary by layer or head); status "ok", or "pending: what
our side still lacks" (measured anyway, never asserted).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's snapkv_lab, before any installed copy (and before _common imports it)
from _common import markdown  # noqa: E402 (benchmarks/ is on sys.path when this script runs)
from kvpress_peer import (  # noqa: E402
    N_TOKENS,
    RATIO,
    ROWS,
    KvpressServer,
    build,
    default_venv,
    kvpress_style_ids,
    n_kept,
    side_by_side,
    venv_problem,
)

from snapkv_lab.tasks.corpus import redact_essays  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# --timing: the rows timed ({timing label: ROWS label}) and the questions asked about each context.
TIMING_ROWS = {"SnapKV": "SnapKV", "ExpectedAttention": "ExpectedAttention", "KVzip": "KVzip",
               "AdaKV(SnapKV)": "AdaKV", "StreamingLLM": "StreamingLLM"}
QUESTIONS = (
    "What is the main topic of the text above?",
    "Summarize the first essay in one sentence.",
    "Which people or companies does the text mention?",
    "What advice does the author give to founders?",
    "What does the author say about programming languages?",
    "What is the last essay about?",
    "Which cities are mentioned in the text?",
    "What does the author think about startups and investors?",
)
WARMUP_TOKENS = 512


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=N_TOKENS, help=f"prompt length (default {N_TOKENS})")
    parser.add_argument("--ratio", type=float, default=RATIO,
                        help=f"kvpress compression_ratio, fraction removed (default {RATIO})")
    parser.add_argument("--venv", type=Path, default=None,
                        help=f"kvpress venv (default {default_venv()}, or $KVPRESS_VENV)")
    parser.add_argument("--only", nargs="*", help="row labels to run (default all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the csv/md results")
    timing = parser.add_argument_group("--timing: wall time side by side (kvpress's query-agnostic protocol)")
    timing.add_argument("--timing", action="store_true", help="time both sides instead of comparing kept positions")
    timing.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192],
                        help="context tokens, chat template head included (default 2048 4096 8192; cut to what the "
                             "model's positions hold with the longest question and the new tokens)")
    timing.add_argument("--repeats", type=int, default=3,
                        help="timed runs per row and side (default 3; the median is reported)")
    timing.add_argument("--questions", type=int, default=4,
                        help=f"questions per context (default 4, at most {len(QUESTIONS)})")
    timing.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per answer, EOS ignored (default 16)")
    timing.add_argument("--threads", type=int, default=None,
                        help="torch threads on both sides (default: this machine's)")
    timing.add_argument("--quiet", type=float, default=0.05, help="redo a timed run during which other processes "
                        "used more than this share of the machine's CPU (default 0.05), after waiting "
                        "for a quiet second")
    timing.add_argument("--tries", type=int, default=4, help="runs at most per timed measurement (default 4)")
    timing.add_argument("--patience", type=float, default=600.0,
                        help="seconds to wait for a quiet second before each run, then run anyway (default 600)")
    timing.add_argument("--context-file", type=Path, help="a text file to use as the context (cut to each length) "
                                                          "instead of the essays")
    timing.add_argument("--question", action="append", help="a question to ask (repeat it; replaces the defaults)")
    args = parser.parse_args(argv)
    if args.timing:
        args.only = args.only or list(TIMING_ROWS)
        unknown = [label for label in args.only if timing_row(label) is None]
        if unknown:
            parser.error(f"unknown rows {unknown}; rows: {list(TIMING_ROWS)} or any of {[row.label for row in ROWS]}")
        if args.repeats < 1 or args.new_tokens < 1 or args.questions < 1 or min(args.lengths) < 64:
            parser.error("--repeats, --new-tokens and --questions must be positive, --lengths at least 64")
        if args.question is None and args.questions > len(QUESTIONS):
            parser.error(f"--questions: at most {len(QUESTIONS)} built-in questions (or pass --question)")
    return args


def timing_row(label: str):
    """The ROWS entry a timing label (or a ROWS label) names, or None."""
    label = TIMING_ROWS.get(label, label)
    return next((row for row in ROWS if row.label == label), None)


def context_text(tokenizer, n_tokens: int, source: str | None = None) -> str:
    """About n_tokens tokens of running text (kvpress's pipeline adds the chat template around it): the essays
    joined (or `source`), cut at a token boundary and decoded. The exact ids are kvpress_style_ids'."""
    if source is None:
        from snapkv_lab.tasks.corpus import paul_graham_essays

        source = "\n\n".join(paul_graham_essays().values())
        while len(source) < 6 * n_tokens:  # ~4 characters a token: enough text, cycled if needed
            source += "\n\n" + source
    ids = tokenizer.encode(source, add_special_tokens=False)
    return source if len(ids) <= n_tokens else tokenizer.decode(ids[:n_tokens])


def fitted_context(tokenizer, target: int, questions: list[str], new_tokens: int, limit: int, source=None):
    """(context text, context ids, question ids) with len(context ids) close to `target` and at most what `limit`
    positions hold after the longest question and the new tokens."""
    head, q_ids = kvpress_style_ids(tokenizer, "", questions)
    target = min(target, limit - max(map(len, q_ids)) - new_tokens)
    text = context_text(tokenizer, target - len(head), source)
    context_ids, q_ids = kvpress_style_ids(tokenizer, text, questions)
    while len(context_ids) > target:  # a cut that re-encodes longer: trim a few characters
        text = text[: -max(1, 2 * (len(context_ids) - target))]
        context_ids, q_ids = kvpress_style_ids(tokenizer, text, questions)
    return text, context_ids, q_ids


def lab_call(model, tokenizer, policy, context: str, questions: list[str], new_tokens: int) -> list[str]:
    """The lab's side of one timed run: kvpress's tokenising, then one compressed prefill and every question on
    its own fork of the compressed cache; the answers decoded as kvpress's pipeline decodes them."""
    import snapkv_lab

    context_ids, question_ids = kvpress_style_ids(tokenizer, context, questions)
    results = snapkv_lab.generate(model, tokenizer, context_ids, policy=policy, question=question_ids,
                                  max_new_tokens=new_tokens)
    return [tokenizer.decode(result.token_ids[0], skip_special_tokens=True) for result in results]


def cpu_timed(call) -> dict:
    """{"answers": call(), "cpu_seconds": this process's CPU time over it, every thread}."""
    start = time.process_time()
    answers = call()
    return {"answers": answers, "cpu_seconds": time.process_time() - start}


class Quiet:
    """The share of the machine's CPU that processes other than ours (this one, the kvpress worker) used over a
    stretch of time, read from /proc: the timing runs share a small machine with whatever else runs on it, and a
    run that others disturbed is redone (see quiet_run). Reads 0 where /proc is missing."""

    def __init__(self, pids):
        self.pids = list(pids)
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _busy(self) -> tuple[float, float]:
        """(every process's busy jiffies, ours)."""
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            ours = 0
            for pid in self.pids:
                stat = Path(f"/proc/{pid}/stat").read_text()
                ours += sum(int(x) for x in stat.rsplit(")", 1)[1].split()[11:13])  # utime, stime
        except (OSError, ValueError):
            return 0.0, 0.0
        return sum(fields) - fields[3] - fields[4], ours  # all but idle and iowait

    def start(self) -> None:
        self._wall, (self._all, self._ours) = time.perf_counter(), self._busy()

    def others(self) -> float:
        """Others' CPU since start(), as a fraction of the whole machine (1.0: every core busy). /proc counts in
        ticks (10 ms), so over a stretch of a few ticks the share is coarse and is capped at 1."""
        wall, (busy, ours) = time.perf_counter() - self._wall, self._busy()
        share = max(0.0, (busy - self._all) - (ours - self._ours)) / self.tick / max(wall, 1e-9) / (os.cpu_count() or 1)
        return min(1.0, share)

    def wait(self, threshold: float, patience: float = 600.0) -> float:
        """Wait (up to `patience` seconds) for a second in which others use less than `threshold`; their share."""
        give_up = time.perf_counter() + patience
        while True:
            self.start()
            time.sleep(1.0)
            share = self.others()
            if share < threshold or time.perf_counter() > give_up:
                return share


def quiet_run(quiet: Quiet, call, threshold: float, tries: int, patience: float = 600.0):
    """(seconds, output, others' share, runs redone) of call(): timed after others have gone quiet, redone (up to
    `tries` runs in all) while others took more than `threshold` of the machine during it."""
    for attempt in range(tries):  # noqa: B007 - read after the loop (the runs redone)
        quiet.wait(threshold, patience)
        gc.collect()
        quiet.start()
        start = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - start
        share = quiet.others()
        if share < threshold:
            break
        print(f"  redone: other processes took {share:.0%} of the machine during that run", file=sys.stderr)
    return seconds, out, share, attempt


def run_timing(args) -> None:
    """--timing: see the module doc."""
    from unittest import mock

    import snapkv_lab
    from snapkv_lab.core.models import bundled_checkpoint

    generation = importlib.import_module("snapkv_lab.compression.generation")
    venv = args.venv or default_venv()
    if problem := venv_problem(venv):
        sys.exit(problem)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    questions = args.question or list(QUESTIONS[: args.questions])
    source = args.context_file.read_text() if args.context_file else None
    rows = {label: timing_row(label) for label in args.only}
    model, tokenizer = snapkv_lab.load_model(device="cpu", dtype="float32", attn_implementation="sdpa")
    limit = model.config.max_position_embeddings
    started = datetime.datetime.now(datetime.timezone.utc)
    loads, noise, table = [os.getloadavg()], [], []
    # EOS ignored, as the worker's generation_config.eos_token_id = []: every answer has --new-tokens tokens.
    with KvpressServer(venv, bundled_checkpoint(), threads) as server, \
            mock.patch.object(generation, "eos_ids", lambda model, tokenizer: ()):
        versions = server.loaded["versions"]
        quiet = Quiet([os.getpid(), server.process.pid])
        print(f"kvpress worker: model and pipeline loaded in {server.loaded['seconds']:.1f} s, "
              f"{server.loaded['threads']} threads", file=sys.stderr)
        warm_text, warm_ids, _ = fitted_context(tokenizer, WARMUP_TOKENS, questions[:1], 2, limit, source)
        for row in rows.values():  # warm-up: every code path once on both sides, untimed
            policy = build(row.ours, n_kept(len(warm_ids), args.ratio))
            lab_call(model, tokenizer, policy, warm_text, questions[:1], 2)
            server.ask(cmd="run", press=row.press.format(ratio=args.ratio), context=warm_text,
                       questions=questions[:1], max_new_tokens=2)
        for target in args.lengths:
            text, context_ids, question_ids = fitted_context(tokenizer, target, questions, args.new_tokens, limit,
                                                             source)
            theirs = server.ask(cmd="prepare", context=text, questions=questions)
            if theirs["context_ids"] != context_ids or theirs["question_ids"] != question_ids:
                sys.exit(f"{target} tokens: kvpress's pipeline tokenises the prompt differently from ours: refused")
            n = len(context_ids)
            if any(row["tokens"] == n for row in table):  # a short --context-file: every length is the whole file
                continue
            capacity = n_kept(n, args.ratio)
            times, disturbed, redos = {label: {"lab": [], "kvpress": []} for label in rows}, [], 0
            cpu = {label: {"lab": [], "kvpress": []} for label in rows}
            answers = {label: {"lab": [], "kvpress": []} for label in rows}
            for repeat in range(args.repeats):
                for index, (label, row) in enumerate(rows.items()):
                    policy = build(row.ours, capacity)
                    press = row.press.format(ratio=args.ratio)
                    sides = ["lab", "kvpress"] if (repeat + index) % 2 == 0 else ["kvpress", "lab"]
                    for side in sides:
                        if side == "lab":
                            call = lambda: cpu_timed(lambda: lab_call(model, tokenizer, policy, text,  # noqa: E731
                                                                      questions, args.new_tokens))
                        else:
                            call = lambda: server.ask(cmd="run", press=press, context=text,  # noqa: E731
                                                      questions=questions, max_new_tokens=args.new_tokens)
                        seconds, said, share, redone = quiet_run(quiet, call, args.quiet, args.tries, args.patience)
                        if side == "kvpress":  # the worker's own clock: its pipeline call alone
                            seconds = said["seconds"]
                        cpu[label][side].append(said["cpu_seconds"])
                        said = said["answers"]
                        times[label][side].append(seconds)
                        answers[label][side].append(said)
                        disturbed.append(share)
                        redos += redone
                    print(f"{n} tokens, repeat {repeat + 1}/{args.repeats}, {label}: lab {times[label]['lab'][-1]:.2f} "
                          f"s, kvpress {times[label]['kvpress'][-1]:.2f} s", file=sys.stderr)
            loads.append(os.getloadavg())
            noise.append((n, max(disturbed), statistics.median(disturbed), redos))
            for label in rows:
                lab, kv = statistics.median(times[label]["lab"]), statistics.median(times[label]["kvpress"])
                pairs = [(a, b) for ours, theirs in zip(answers[label]["lab"], answers[label]["kvpress"])
                         for a, b in zip(ours, theirs, strict=True)]
                table.append(dict(method=label, tokens=n, kept=capacity, lab_s=round(lab, 3), kvpress_s=round(kv, 3),
                                  lab_over_kvpress=round(lab / kv, 3),
                                  lab_cpu_s=round(statistics.median(cpu[label]["lab"]), 3),
                                  kvpress_cpu_s=round(statistics.median(cpu[label]["kvpress"]), 3),
                                  same_answers=round(sum(a == b for a, b in pairs) / len(pairs), 3),
                                  lab_runs=" ".join(f"{t:.3f}" for t in times[label]["lab"]),
                                  kvpress_runs=" ".join(f"{t:.3f}" for t in times[label]["kvpress"]),
                                  lab_answer=redact_essays(answers[label]["lab"][-1][0]),
                                  kvpress_answer=redact_essays(answers[label]["kvpress"][-1][0])))
    finished = datetime.datetime.now(datetime.timezone.utc)
    write_timing(args, pd.DataFrame(table), versions, threads, len(questions), started, finished, loads, noise)


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def write_timing(args, table: pd.DataFrame, versions: dict, threads: int, n_questions: int, started, finished,
                 loads, noise) -> None:
    import snapkv_lab

    load_text = ", ".join(f"{one:.2f}" for one, _, _ in loads)
    noise_text = "; ".join(f"{n} tokens: at most {worst:.0%} (median {median:.0%}), {redos} run(s) redone"
                           for n, worst, median, redos in noise)
    command = "python3 benchmarks/kvpress_side_by_side.py " + shlex.join(sys.argv[1:])
    header = (f"kvpress {versions['kvpress']} (transformers {versions['transformers']}, its pipeline) vs snapkv_lab "
              f"{snapkv_lab.__version__} (transformers {__import__('transformers').__version__}, `generate`), torch "
              f"{torch.__version__}, on the bundled SmolLM2-135M-Instruct, fp32, sdpa, CPU, {threads} threads each; "
              f"query-agnostic: one context compressed once (compression_ratio {args.ratio}, kept = capacity = "
              f"n_kept per KV head), then {n_questions} questions, {args.new_tokens} greedy tokens each (EOS ignored); "
              f"median of {args.repeats}, the sides alternating. {started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC on "
              f"{os.cpu_count()} CPUs ({cpu_model()}); "
              f"1-minute load average at the start and after each length: {load_text}. Other processes' share of the "
              f"machine's CPU during the timed runs (a run is redone above {args.quiet:.0%}): {noise_text}.")
    shown = table.drop(columns=["lab_answer", "kvpress_answer"])
    markdown_table = markdown(shown, {"lab_s": ".2f", "kvpress_s": ".2f", "lab_over_kvpress": ".2f",
                                      "same_answers": ".2f", "lab_cpu_s": ".2f", "kvpress_cpu_s": ".2f"})
    print(header + "\n\n" + markdown_table)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "kvpress_timing.csv", index=False)
    (args.out / "kvpress_timing.md").write_text(
        f"# snapkv_lab vs kvpress, wall time\n\n{header}\n\nCommand: `{command}`\n\n{markdown_table}\n")
    print(f"\nwrote {args.out}/kvpress_timing.csv and .md", file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not 0 < args.ratio < 1:
        sys.exit(f"--ratio must lie in (0, 1), got {args.ratio}")
    if args.timing:
        return run_timing(args)
    venv = args.venv or default_venv()
    if problem := venv_problem(venv):
        sys.exit(problem)
    rows = [row for row in ROWS if not args.only or row.label in args.only]
    if args.only and len(rows) != len(args.only):
        sys.exit(f"unknown rows {sorted(set(args.only) - {row.label for row in rows})}; rows: "
                 f"{[row.label for row in ROWS]}")

    import snapkv_lab

    start = time.perf_counter()
    result = side_by_side(venv, rows, args.tokens, args.ratio)
    print(result.kvpress_log, file=sys.stderr)
    print(f"both sides: {time.perf_counter() - start:.0f} s (ours {result.seconds['ours']:.0f} s, kvpress's worker "
          f"{result.seconds['kvpress']:.0f} s)", file=sys.stderr)

    summary, detail = [], []
    for label, agreement in result.rows.items():
        status = f"pending: {agreement.pending}" if agreement.pending else "ok"
        line = dict(method=label, ours=agreement.policy_label, kvpress=agreement.press, status=status)
        if agreement.error:
            summary.append({**line, "note": f"kvpress failed: {agreement.error}. {agreement.row.why}"})
            continue
        worst = agreement.worst_layer
        summary.append({**line, "jaccard_mean": round(agreement.jaccard_mean, 4),
                        "jaccard_min_layer": round(agreement.layers[worst]["jaccard"], 4), "worst_layer": worst,
                        "identical_layers": round(agreement.identical_layers, 4), "kept_ours": agreement.kept("ours"),
                        "kept_theirs": agreement.kept("theirs"), "note": agreement.row.why})
        detail += [dict(method=label, layer=i, jaccard=round(layer["jaccard"], 4), identical=layer["identical"],
                        kept_ours=" ".join(map(str, layer["kept_ours"])),
                        kept_theirs=" ".join(map(str, layer["kept_theirs"])))
                   for i, layer in enumerate(agreement.layers)]

    table = pd.DataFrame(summary)
    header = (f"kvpress {result.versions['kvpress']} (transformers {result.versions['transformers']}) vs "
              f"snapkv_lab {snapkv_lab.__version__} (transformers {__import__('transformers').__version__}) on "
              f"{result.model}, fp32, sdpa, {torch.get_num_threads()} threads; {result.n_tokens}-token "
              f"prompt (chat template head + Paul Graham essays), compression_ratio {args.ratio}, n_kept = capacity = "
              f"{result.capacity}; max |logit gap| of the two uncompressed prefills: {result.logit_gap:.2e}")
    shown = table.astype(object).where(table.notna(), "-")
    markdown_table = markdown(shown, {c: ".4f" for c in table.columns if c.startswith(("jaccard", "identical"))})
    print(header + "\n\n" + markdown_table)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "kvpress_side_by_side.csv", index=False)
    pd.DataFrame(detail).to_csv(args.out / "kvpress_side_by_side_layers.csv", index=False)
    (args.out / "kvpress_side_by_side.md").write_text(
        f"# snapkv_lab vs kvpress, kept positions\n\n{header}\n\nCommand: `python3 benchmarks/kvpress_side_by_side.py "
        f"--tokens {args.tokens} --ratio {args.ratio}`\n\n{markdown_table}\n")
    print(f"\nwrote {args.out}/kvpress_side_by_side.csv, .md and kvpress_side_by_side_layers.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
