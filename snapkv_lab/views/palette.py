"""The lab's figure styles, shared by every study's figures: the heatmaps' colour map and the policies' lines."""

from __future__ import annotations

HEATMAP_COLOURS = "viridis"
# Okabe-Ito: distinguishable with any colour vision.
LINE_COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
# Dashes of the second and third round of colours (":" is the full cache's line).
LINE_DASHES = ["-", "--", "-."]


def line_style(i: int) -> dict:
    """The colour, marker and dash of a figure's i-th policy line (matplotlib keywords). Each round of eight colours
    takes the next dash and shifts the markers, so that no two of the first 24 lines look alike (a leaderboard of
    every policy has 24)."""
    rounds = i // len(LINE_COLOURS)
    return dict(color=LINE_COLOURS[i % len(LINE_COLOURS)], marker=MARKERS[(i + rounds) % len(MARKERS)],
                ls=LINE_DASHES[rounds % len(LINE_DASHES)])
