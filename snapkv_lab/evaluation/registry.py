"""DATASETS: every benchmark `evaluate` runs, by the name `--dataset` takes.

"ruler" is generated here, offline, at any length and seed, and so are "nolima"'s generated tasks (evaluation.nolima);
the others are read from the Hugging Face Hub as their authors (or kvpress, for "ruler-hub" and "needle-hub") publish
them, or from a local copy (`source=`).
"""

from __future__ import annotations

from .examples import Benchmark
from .hub import NEEDLE_HUB, RULER_HUB
from .infinitebench import INFINITEBENCH
from .longbench import LONGBENCH, LONGBENCH_E, LONGBENCH_V2
from .loogle import LOOGLE
from .nolima import NOLIMA
from .reasoning import AIME25, MATH500
from .ruler import RULER
from .scbench import SCBENCH

DATASETS: dict[str, Benchmark] = {benchmark.name: benchmark for benchmark in (
    RULER, LONGBENCH, LONGBENCH_E, LONGBENCH_V2, INFINITEBENCH, LOOGLE, SCBENCH, RULER_HUB, NEEDLE_HUB, AIME25,
    MATH500, NOLIMA)}
