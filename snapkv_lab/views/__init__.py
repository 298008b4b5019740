"""Views of a trace and of what a compressed cache keeps, for notebooks.

    tiles.py      AttentionTiles: exact attention at any zoom, pooled into blocks (max and mean)
    explorer.py   explore(): a map of one head's attention, drag to zoom, overlays, the heads grid
    plots.py      heatmaps, a per-token spotlight, window attention
    heads.py      per-head statistics of a trace and the layer x head grid
    coverage.py   attention_coverage: how much of the generation's attention a policy's kept positions hold
    causal.py     causal_coverage: how much of the answer's eviction effect a policy's kept positions protect
    palette.py    the lab's figure styles (colour maps, policy lines)
"""
