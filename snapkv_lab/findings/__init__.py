"""The findings study: the SnapKV paper's four observations, measured on real runs, with intervals.

    experiments.py    the four experiments as functions from traces to tidy tables; their cells; the "findings" set
    report.py         verdicts per split and mode from the committed tables
    findings_plots.py the findings' figures
    head_types.py     finding (b) split by retrieval heads and the others
    heads_study.py    the "heads" figure set: retrieval heads measured afresh, and drawn
    heads_plots.py    its figures
    legacy.py         tables and options written before a rename, read with today's names
"""
