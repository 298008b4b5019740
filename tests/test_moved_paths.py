"""The module paths of the flat package (before 2026-11-28) still import, warn, and hold the names they held.

MOVED lists each former module, where it went, and every public name it defined then (read off the code of
2026-11-28, before the move): `import snapkv_lab.<old>` must warn with a DeprecationWarning naming the new path (at
the import, or, for snapkv_lab.capture, whose name is the function's, at the first name read), and each name must
read as the object the package holds now. Run in a fresh interpreter, where no alias was imported
before (a module warns once, when first imported).
"""

from __future__ import annotations

import json
import subprocess
import sys

import snapkv_lab

MOVED = {
    "ab": ("compression.compare", ["ABTable", "HIGHLIGHT_STYLE", "VERDICTS", "compare", "kept_tokens_html"]),
    "attention": ("core.attention", ["AttentionSettings", "BLOCK_ELEMENTS", "attention_column_max",
                                     "attention_column_sums", "attention_logits", "attention_probs",
                                     "attention_row_blocks", "attention_row_topk"]),
    "capture": ("core.capture", ["capture"]),
    "cli": ("app.cli", ["DESCRIPTION", "build_parser", "main"]),
    "commands": ("app.commands", ["COMMANDS", "Command", "NEEDLE_SUITE", "convert", "evaluate", "figures", "needle"]),
    "corpus": ("tasks.corpus", ["CODE_MODULES", "ESSAY_RUN_WORDS", "HAYSTACK_WHEEL", "SOURCES", "haystack_ids",
                                "paul_graham_essays", "pydoc_topics", "pydoc_topics_checksum", "redact_essays",
                                "stdlib_code"]),
    "coverage": ("views.coverage", ["COLUMNS", "GenerationAttention", "ReducedAttention", "attention_coverage",
                                    "coverage_summary", "kept_mask_for", "layer_spread", "sinks_rows",
                                    "span_attention"]),
    "docs_tables": ("app.docs_tables", ["BLOCKS", "Block", "RESULTS", "rendered", "stale", "write"]),
    "evaluation.figures": ("evaluation.leaderboard_plots", ["BASELINE", "GAP_COLOURS", "SCORE_LABEL", "by_difference",
                                                            "counted", "difference_figure", "draw", "gap_figure",
                                                            "heatmap_figure", "leaderboard_figure", "middle_budget"]),
    "experiments": ("findings.experiments", ["DEFAULTS", "MODES", "OBS_WINDOWS", "ORDER", "SELECTIONS", "SPLITS",
                                             "TOP_P", "WORK", "chat_cell", "dependence_cell", "dependence_rows",
                                             "document_selections", "draw", "findings_cell", "findings_cells",
                                             "findings_tables", "generation_consistency", "placement_cell",
                                             "pool_heads", "prompt_segments", "question_dependence",
                                             "question_placement", "run_findings", "select_mask"]),
    "explorer": ("views.explorer", ["Explorer", "LABELLED_TOKENS", "STATS", "explore"]),
    "figures": ("app.figure_sets", ["FIGURE_MODULES", "FIGURE_SETS", "FigureSet", "folder_name", "load_figure_sets",
                                    "make_figures", "model_data_folders", "model_folders", "register", "write_html",
                                    "write_png"]),
    "findings_figures": ("findings.findings_plots", ["CI", "FIGURES", "Grid", "LOW_SUPPORT", "PLACEMENTS",
                                                     "SPLITS_ORDER", "SPLIT_NAMES", "Y_LABELS", "draw_findings",
                                                     "draw_html", "draw_png", "figure_a", "figure_b",
                                                     "figure_b_selection", "figure_b_windows", "figure_c", "figure_d",
                                                     "head_figure", "layer_groups", "layer_ranges"]),
    "findings_report": ("findings.report", ["CI", "CLAIMS", "MEASURES", "Undefined", "layer_groups", "markdown",
                                            "read_run", "read_tables", "report", "short_verdict", "side_by_side",
                                            "verdicts"]),
    "framing": ("core.framing", ["FRAMINGS", "Frame", "PLACEHOLDER", "SPEAKERS", "bos_text", "chat_frame", "framed_ids",
                                 "plain_prompt", "plain_turns", "prompt_frame", "require_chat_template",
                                 "resolve_framing"]),
    "head_types": ("findings.head_types", ["HEAD_TYPES", "RETRIEVAL_THRESHOLD", "findings_by_head_type", "head_types"]),
    "heads": ("views.heads", ["COLUMNS", "HeadsGrid", "METRICS", "NORMALISATIONS", "PROMPT_ROWS", "SPAN_SCORE",
                              "copy_steps", "head_table", "heads_grid", "heads_grid_figure", "layer_head_grid",
                              "retrieval_hits", "sink_and_local_shares", "window_recall"]),
    "heads_figures": ("findings.heads_plots", ["draw_head_types", "draw_retrieval_heads"]),
    "hooks": ("core.hooks", ["attention_modules", "capture_final_hidden", "intercept_attention", "model_eager_function",
                             "returned_cache", "with_cache"]),
    "inputs": ("core.inputs", ["Batch", "PADDING_REFUSED", "check_context_length", "encode_batch",
                               "encode_continuation", "encode_prompt", "eos_ids", "extended_mask", "left_pads",
                               "pad_id", "padded_positions", "tensor_batch"]),
    "kept": ("compression.kept", ["kept_mask"]),
    "legacy": ("findings.legacy", ["COLUMNS", "OPTIONS", "read_table", "upgrade_options"]),
    "metrics": ("core.overlap", ["COARSE_THRESHOLD", "COLUMNS", "MIN_SUPPORT", "PARTS", "RESAMPLES", "SinkRule",
                                 "THETA", "attention_recall", "coarse_overlap", "difference", "hit_rate", "metric_rows",
                                 "resample_counts", "selection_overlap", "selection_vs_generation", "summarise",
                                 "to_mask"]),
    "models": ("core.models", ["ALIASES", "ATTN_IMPLEMENTATIONS", "BUNDLED_MODELS", "BundledModel", "DEFAULT_MODEL",
                               "ModelNotFoundError", "bundled_checkpoint", "bundled_gguf_path", "bundled_model",
                               "cache_dir", "check_model", "load_model", "load_tokenizer", "measured_cache_path",
                               "model_name", "model_source", "sliding_layers"]),
    "plots": ("views.plots", ["attention_heatmap", "block_max", "coverage_figure", "spotlight", "token_attention",
                              "window_attention", "window_attention_figure"]),
    "pressure.figures": ("pressure.pressure_plots", ["FOUND_LABEL", "HEATMAP_COLOURS", "LINE_COLOURS", "LINE_DASHES",
                                                     "MARKERS", "draw", "draw_ablations", "found_counts", "line_style",
                                                     "lines_figure", "methods_figure", "model_name", "needle_budget",
                                                     "needle_heatmaps", "ruler_figure"]),
    "pressure.haystacks": ("tasks.haystacks", ["HAYSTACKS", "LEVELS", "NEEDLES", "SERVICES", "boundary",
                                               "check_haystack", "haystack_tokens", "needle_template", "word_key"]),
    "pressure.ruler": ("tasks.ruler_needles", ["ANSWER", "ANSWER_ALL", "NEEDLE", "QUESTION", "QUESTION_ALL", "TASKS",
                                               "VALUE_KINDS", "ruler_context"]),
    "pressure.tasks": ("tasks.needles", ["Context", "LINE", "LINES_ANSWER", "LINES_HEAD", "LINES_QUESTION",
                                         "NEEDLE_ANSWER", "NEEDLE_QUESTION", "Query", "found", "found_exactly",
                                         "lines_context", "needle_context", "sentence_start"]),
    "progress": ("core.progress", ["LOG_INTERVAL_S", "progress_bar"]),
    "prompts": ("tasks.prompts", ["CHAT_REQUEST", "Prompt", "QUESTIONS", "chat_prompt", "chat_prompts", "load_recipes",
                                  "make_recipes", "qa_prompt", "qa_prompts", "save_recipes"]),
    "query_filters": ("policies.query_filters", ["filters_path", "query_filters"]),
    "retrieval_heads": ("policies.retrieval_heads", ["COLUMNS", "DEPTHS", "LENGTHS", "TABLE", "draw", "recompute",
                                                     "retrieval_heads", "retrieval_score_grid"]),
    "rope": ("core.rope", ["LayerRope"]),
    "selection": ("core.selection", ["GQA_REDUCTIONS", "POOLINGS", "pool_votes", "select", "select_from_trace",
                                     "topk_count", "votes_per_kv_head", "window_votes"]),
    "tiles": ("views.tiles", ["AttentionTiles", "HEAD_MEAN", "Tile", "as_head", "as_span", "cell_counts",
                              "next_power_of_two", "pool_blocks"]),
    "timing": ("core.timing", ["Elapsed", "SectionTimer", "ms_per_token", "over_full_cache", "stopwatch",
                               "synchronize"]),
    "tokens": ("core.tokens", ["decoded_offsets", "encode", "token_span"]),
    "trace": ("core.trace", ["AttentionTrace", "LazyLayers", "positions"]),
}

CHECK = """
import importlib, json, sys, warnings
moved = json.loads(sys.argv[1])
report = {}
for old, (new, names) in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("snapkv_lab." + old)
        missing = [name for name in names if not hasattr(module, name)]
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    report[old] = dict(warned=any("snapkv_lab." + new in text for text in said), missing=missing)
print(json.dumps(report))
"""


def test_every_former_module_path_imports_warns_and_holds_its_names():
    result = subprocess.run([sys.executable, "-c", CHECK, json.dumps(MOVED)], capture_output=True, text=True,
                            check=True)
    report = json.loads(result.stdout.splitlines()[-1])
    assert not [old for old, seen in report.items() if not seen["warned"]], report
    assert {old: seen["missing"] for old, seen in report.items() if seen["missing"]} == {}


def test_the_names_read_through_an_old_path_are_the_new_modules_objects():
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, (new, names) in MOVED.items():
            module = importlib.import_module(f"snapkv_lab.{old}")
            for name in names:
                owner = next(m for m in (importlib.import_module(f"snapkv_lab.{new}"), module) if hasattr(m, name))
                assert getattr(module, name) is getattr(owner, name), (old, name)


def test_capture_stays_the_function_when_its_old_module_path_is_imported():
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("snapkv_lab.capture")
        from snapkv_lab.capture import capture
    from snapkv_lab.core.capture import capture as new

    assert snapkv_lab.capture is new and capture is new and module.capture is new
    assert callable(snapkv_lab.capture)


def test_a_monkeypatch_through_an_old_path_reaches_the_code_that_reads_the_name(monkeypatch):
    """Through an alias of one module (the module itself) and of several (each name set where it lives)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import snapkv_lab.figures as old_figures
        import snapkv_lab.models as old_models
    from snapkv_lab.app import figure_sets
    from snapkv_lab.core import figure_files, models

    monkeypatch.setattr(old_models, "DEFAULT_MODEL", "x")
    assert models.DEFAULT_MODEL == "x"
    monkeypatch.setattr(old_figures, "make_figures", len)
    monkeypatch.setattr(old_figures, "write_png", len)
    assert figure_sets.make_figures is len and figure_files.write_png is len
    monkeypatch.undo()
    assert figure_sets.make_figures is not len and figure_files.write_png is not len


def test_every_public_name_of_the_package_imports():
    for name in snapkv_lab.__all__:
        assert getattr(snapkv_lab, name) is not None, name
