"""The names the command line refuses a misspelling of before it imports torch: the benchmarks and their tasks, and
the pressure suites. The registries themselves (evaluation.DATASETS, pressure.SUITES) import torch and transformers,
some 25 s on a small machine; these are plain tables, as figure_sets.FIGURE_MODULES is, and tests/test_cli.py checks
them against the registries so that they cannot drift."""

from __future__ import annotations

RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
# evaluation.DATASETS: each benchmark's name, as --dataset takes it, and its tasks, as --tasks takes them, in order.
DATASET_TASKS = {
    "ruler": RULER_TASKS,
    "longbench": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
                  "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
                  "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p"),
    "longbench-e": ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
                    "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"),
    "longbench-v2": ("0shot",),
    "infinitebench": ("passkey", "number_string", "kv_retrieval", "longbook_sum_eng", "longbook_choice_eng",
                      "longbook_qa_eng", "longbook_qa_chn", "longdialogue_qa_eng", "math_find", "math_calc", "code_run",
                      "code_debug"),
    "loogle": ("shortdep_qa", "shortdep_cloze", "longdep_qa", "longdep_summarization"),
    "scbench": ("scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_qa_eng", "scbench_qa_chn",
                "scbench_choice_eng", "scbench_many_shot", "scbench_summary", "scbench_mf",
                "scbench_summary_with_needles"),
    "ruler-hub": RULER_TASKS,
    "needle-hub": ("needle_in_haystack",),
    "aime25": ("aime25",),
    "math500": ("math500",),
    "nolima": ("onehop", "twohop", "generated", "generated_literal"),
}
# evaluation.LEADERBOARD["datasets"]: the tasks `figures --samples TASK=N` may name.
LEADERBOARD_DATASETS = ("ruler",)
# pressure.SUITES, in its order: the names `needle --suites` takes.
SUITE_NAMES = ("needle", "lines", "windows", "ablations", "fact-kernel", "question-free", "surprisal", "ruler",
               "haystacks", "surprisal-ruler", "methods", "presses")
