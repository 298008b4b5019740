"""The figure set "heads": which heads retrieve (policies.retrieval_heads, measured afresh into
data/retrieval_heads.csv), drawn as the layer x head grid, and finding (b) split by head type where the findings'
tables are there too."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..core.figure_files import FigureSet, register
from ..policies.retrieval_heads import retrieval_heads

TABLE = "retrieval_heads.csv"


def recompute(options: dict) -> None:
    """Measure the retrieval heads of options["model"] (None: the default bundled model) afresh, into
    <data_dir>/retrieval_heads.csv (the figure set "heads")."""
    from ..core.models import load_model  # torch and transformers load only when a recompute runs

    model, tokenizer = load_model(options.get("model"), device="cpu")
    table = retrieval_heads(model, tokenizer, cache=False)
    table.to_csv(Path(options["data_dir"]) / TABLE, index=False)


def draw(data_dir, figures_dir) -> list[Path]:
    """The retrieval-head grid, and finding (b) by head type where data_dir has its findings_b.csv too."""
    from .head_types import findings_by_head_type
    from .heads_plots import draw_head_types, draw_retrieval_heads
    from .legacy import read_table

    data_dir, figures_dir = Path(data_dir), Path(figures_dir)
    if not (data_dir / TABLE).exists():
        return []
    table = pd.read_csv(data_dir / TABLE)
    written = draw_retrieval_heads(table, figures_dir)
    if (data_dir / "findings_b.csv").exists():
        written.append(draw_head_types(findings_by_head_type(read_table(data_dir / "findings_b.csv"), table),
                                       figures_dir))
    return written


register(FigureSet(name="heads", recompute=recompute, draw=draw))
