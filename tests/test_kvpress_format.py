"""kvpress's evaluation files both ways (evaluation.kvpress_format): a run exported then read back gives its task
scores; the files written have the keys, columns and metric names of kvpress's own (tests/fixtures/kvpress, written by
hand from kvpress's evaluate.py and RULER scorer: see its README)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from snapkv_lab.evaluation import read_results, task_scores
from snapkv_lab.evaluation.kvpress_format import export_kvpress, metrics, read_kvpress, string_match

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "kvpress"
# get_results_dir's names of RULER runs (NVIDIA/kvpress 8bb29b9, evaluation/evaluate.py:126-149)
FOLDER = re.compile(r"ruler__\d+__[^/]+__[^/]+__\d\.\d\d(__query_aware)?")


# kvpress's RULER scorer, as evaluation/benchmarks/ruler/calculate_metrics.py:10-43 (8bb29b9) writes it.
def _string_match_part(preds, refs):
    return round(sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs))
                 / len(preds) * 100, 2)


def _string_match_all(preds, refs):
    return round(sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref) for p, ref in zip(preds, refs))
                 / len(preds) * 100, 2)


def kvpress_scorer(df: pd.DataFrame) -> dict:
    df = df.assign(predicted_answer=df.predicted_answer.map(lambda x: re.sub(r"[\x00-\x1f]", "", x.strip()).strip()))
    return {task: {"string_match": (_string_match_part if task.split("_")[0] == "qa" else _string_match_all)(
        part.predicted_answer.tolist(), part.answer.tolist())} for task, part in df.groupby("task")}


def numpy_list(cell: str) -> list[str]:
    """An answer cell as pandas writes a numpy array of strings: "['a' 'b']" (wrapped lines included)."""
    return re.findall(r"'([^']*)'", cell)


def read_predictions(folder: Path) -> pd.DataFrame:
    table = pd.read_csv(folder / "predictions.csv", dtype={"predicted_answer": str, "question": str},
                        keep_default_na=False)
    return table.assign(answer=table.answer.map(numpy_list))


@pytest.fixture(scope="module")
def run() -> pd.DataFrame:
    """A real run: the committed leaderboard (SmolLM2, RULER 4k), three policies at every ratio and mode."""
    table = read_results(ROOT / "data" / "eval_ruler.csv")
    return table[table.policy.isin(["FullCache", "SnapKV", "KNorm", "AdaKV"])].reset_index(drop=True)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kvpress")
    export_kvpress(run, out)
    return out


def test_fixture_metrics_are_kvpress_scorer():
    """The fixture is self-consistent with kvpress's scorer, and the lab's metrics() computes the same."""
    for folder in sorted(FIXTURE.iterdir()):
        if folder.is_dir():
            predictions = read_predictions(folder)
            written = json.loads((folder / "metrics.json").read_text())
            assert written == kvpress_scorer(predictions), folder.name
            assert metrics(predictions) == written, folder.name


def test_export_has_kvpress_files_keys_and_columns(run, exported):
    folders = sorted(p for p in exported.iterdir())
    # one folder per policy x ratio x mode, the full cache once
    compressed = run[run["mode"] != "full"].groupby(["policy", "ratio", "mode"]).ngroups
    assert len(folders) == compressed + 1
    reference = FIXTURE / "ruler__4096__Qwen--Qwen3-8B__snapkv__0.50__query_aware"
    keys = list(yaml.safe_load((reference / "config.yaml").read_text()))
    columns = set(pd.read_csv(reference / "predictions.csv").columns)
    for folder in folders:
        assert FOLDER.fullmatch(folder.name), folder.name
        assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in reference.iterdir() if p.is_file())
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert list(config) == keys  # kvpress's fields, in its order
        assert folder.name.endswith("__query_aware") == config["query_aware"]
        assert set(pd.read_csv(folder / "predictions.csv").columns) == columns
        scores = json.loads((folder / "metrics.json").read_text())
        assert scores and all(list(value) == ["string_match"] for value in scores.values())
        # the written metrics are kvpress's scorer on the written predictions
        assert scores == kvpress_scorer(read_predictions(folder))
    full = exported / "ruler__4096__SmolLM2-135M-Instruct__no_press__0.00"
    assert yaml.safe_load((full / "config.yaml").read_text())["compression_ratio"] == 0.0


def test_export_then_import_gives_the_run_table(run, exported):
    """The task scores read back from the exported files are the run's (metrics.json rounds to 2 decimals), on a run
    whose predictions kvpress's scorer and RULER's score alike (where they do not, the files hold kvpress's:
    test_import_reads_kvpress_score_where_the_scorers_differ)."""
    back = read_kvpress(exported)
    ours = task_scores(run, n_boot=0)
    # task_scores repeats the full cache's rows under each mode, as its lines' baseline; the run has them once
    ours = ours[ours.policy != "FullCache"].merge(ours[ours.policy == "FullCache"].assign(mode="full")
                                                  .drop_duplicates(), how="outer")
    key = ["dataset", "length", "task", "policy", "ratio", "mode"]
    merged = ours.merge(back, on=key, how="outer", suffixes=("", "_kvpress"), indicator=True)
    assert (merged._merge == "both").all(), merged[merged._merge != "both"][key]
    assert (merged.score - merged.score_kvpress).abs().max() <= 0.005 + 1e-9
    assert (merged.examples == merged.examples_kvpress).all()
    assert set(back.model) == {"SmolLM2-135M-Instruct"}


def test_import_reads_kvpress_score_where_the_scorers_differ(run, tmp_path):
    """kvpress's scorer removes control characters (calculate_metrics.py:33-34), RULER's metric reads a newline as a
    space: a reference split by a line break is found by kvpress's and missed by RULER's (the committed leaderboard has
    one such row: HeadKV at 0.75 without the question, niah_multivalue, "435134\n4."). The exported files, and what
    is read back from them, hold kvpress's score, as its leaderboard would; the lab's table keeps RULER's."""
    row = run[(run.policy == "SnapKV") & (run.task == "niah_single_1")].iloc[[0]]
    reference = json.loads(row.references.iloc[0])[0]
    split = row.assign(prediction=f"The number is {reference[:3]}\n{reference[3:]}.", score=0.0)
    full = run[(run.policy == "FullCache") & (run.example == row.example.iloc[0]) & (run.task == "niah_single_1")]
    export_kvpress(pd.concat([full, split], ignore_index=True), tmp_path)
    back = read_kvpress(tmp_path).set_index(["policy", "mode"]).score
    assert back[(row.policy.iloc[0], row["mode"].iloc[0])] == 100.0
    assert string_match("niah_single_1", split.prediction.iloc[0], [reference]) == 100.0


def test_read_kvpress_fixture():
    scores = read_kvpress(FIXTURE).set_index(["policy", "ratio", "mode", "task"]).score
    assert scores[("FullCache", 0.0, "full", "vt")] == 83.33
    assert scores[("snapkv", 0.5, "query-aware", "qa_1")] == 100.0
    # the folder says 0.88 (f"{0.875:.2f}"): the ratio is config.yaml's
    assert scores[("knorm", 0.875, "query-agnostic", "niah_single_1")] == 50.0
    assert len(scores) == 9


def test_scorer_drops_control_characters_as_kvpress_does():
    """calculate_metrics.py:33-34 removes control characters (RULER's own scripts turn them into newlines, which
    splits a number): the exported metric is kvpress's."""
    assert string_match("niah_single_1", "82\x0027610", ["8227610"]) == 100.0
    assert string_match("vt", "X then Y", ["x", "y", "z", "w"]) == 50.0
    assert string_match("qa_2", "Paris", ["London", "paris"]) == 100.0


def test_export_refuses_what_kvpress_cannot_hold(run, tmp_path):
    with pytest.raises(ValueError, match="capacities"):
        export_kvpress(run.assign(capacity=pd.array([64] * len(run), dtype="Int64")), tmp_path)
    with pytest.raises(ValueError, match="RULER"):
        export_kvpress(run.assign(dataset="longbench"), tmp_path)
    with pytest.raises(FileNotFoundError, match="no kvpress results"):
        read_kvpress(tmp_path)


def test_cli_eval_exports_and_draws_kvpress_results_beside_the_run(run, tmp_path, monkeypatch, capsys):
    """`snapkv-lab eval --export kvpress DIR --import DIR`: the run's table written in kvpress's format, and kvpress's
    results (the fixture) drawn in the leaderboard figure, averaged over the run's tasks."""
    import snapkv_lab.evaluation as evaluation
    from snapkv_lab.app.cli import main
    from snapkv_lab.evaluation.leaderboard_plots import peer_points

    small = run[run.policy.isin(["FullCache", "SnapKV"]) & run.task.isin(["niah_single_1", "vt"])]

    def fake_evaluate(model, *, data_dir, name=None, **options):  # a run, as `evaluate` writes it
        small.to_csv(Path(data_dir) / "eval_ruler.csv", index=False)
        return small

    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    drawn = []
    draw = evaluation.draw
    monkeypatch.setattr(evaluation, "draw", lambda *args, peers=None, **kwargs: drawn.append(peers)
                        or draw(*args, peers=peers, **kwargs))
    out = tmp_path / "kvpress"
    assert main(["eval", "--tasks", "niah_single_1", "vt", "--limit", "1", "--policies", "SnapKV", "--data-dir",
                 str(tmp_path), "--import", str(FIXTURE), "--export", "kvpress", str(out)]) == 0
    assert f"7 folders (config.yaml, metrics.json, predictions.csv) in {out}" in capsys.readouterr().out
    assert sorted(set(read_kvpress(out).policy)) == ["FullCache", "SnapKV"]
    points = peer_points(drawn.pop(), small).set_index(["policy", "ratio", "mode"])
    # the fixture's three folders, each averaged over the run's two tasks (its qa_1 left out)
    assert points.score.to_dict() == {("FullCache", 0.0, "full"): (100.0 + 83.33) / 2,
                                      ("kvpress knorm (Qwen3-8B)", 0.875, "query-agnostic"): 50.0,
                                      ("kvpress snapkv (Qwen3-8B)", 0.5, "query-aware"): (50.0 + 16.67) / 2}
    assert (tmp_path / "figures" / "eval_ruler_leaderboard.png").is_file()


@pytest.mark.parametrize("options, said", [
    (["--export", "csv", "out"], "--export csv: the formats are kvpress"),
    (["--export", "kvpress", "out", "--capacities", "64"], "capacities in tokens"),
    (["--import", "no/such/folder"], "no such folder of kvpress results"),
])
def test_cli_eval_refuses_bad_kvpress_options_before_running(options, said, tmp_path, monkeypatch, capsys):
    import snapkv_lab.evaluation as evaluation
    from snapkv_lab.app.cli import main

    monkeypatch.setattr(evaluation, "evaluate", lambda *args, **kwargs: pytest.fail("ran"))
    assert main(["eval", "--tasks", "niah_single_1", "--data-dir", str(tmp_path), *options]) == 2
    assert said in capsys.readouterr().err


LEADERBOARD_RATIOS = [0.25, 0.5, 0.75, 0.875]  # kvpress's leaderboard (evaluation/leaderboard.sh:16-19)


def test_ratio_0875_runs_through_eval_tables_figures_and_the_kvpress_files(tmp_path, monkeypatch):
    """kvpress's fourth ratio, 0.875 (one eighth kept), through everything a ratio touches: the parsers of eval and
    scorer-allocation, the cells, the run (its budget kept exactly), the leaderboard and its figure, the exported
    folder (named 0.88, as kvpress's f"{ratio:.2f}" names it) and the ratio read back (0.875, from config.yaml)."""
    from conftest import ByteTokenizer, make_tiny_llama
    from test_eval_run import ToyBenchmark

    from snapkv_lab.app.cli import build_parser
    from snapkv_lab.app.scorer_allocation import study_cells
    from snapkv_lab.evaluation import evaluate, leaderboard, registry
    from snapkv_lab.evaluation.leaderboard_plots import leaderboard_figure, middle_budget

    ratios = [str(r) for r in LEADERBOARD_RATIOS]
    assert build_parser().parse_args(["eval", "--ratios", *ratios]).ratios == LEADERBOARD_RATIOS
    assert build_parser().parse_args(["scorer-allocation", "--ratios", *ratios]).ratios == LEADERBOARD_RATIOS
    cells = study_cells(tasks=["niah_single_1"], samples=1, ratios=LEADERBOARD_RATIOS)
    # RULER's cells hold kvpress's ratios, the needles' the shares kept (1 - 0.875: an eighth, not 0.12499...)
    assert {c.kind for c in cells} == {"eval", "pressure"}
    assert all(c.config["budgets"][-1] == {"ratio": 0.875} for c in cells if c.kind == "eval")
    assert all(c.config["capacities"][-1] == 0.125 for c in cells if c.kind == "pressure")

    monkeypatch.setitem(registry.DATASETS, "toy", ToyBenchmark())
    monkeypatch.setattr("snapkv_lab.sweep.executors._load_model", lambda name: (make_tiny_llama(), ByteTokenizer()))
    table = evaluate(datasets=["toy"], policies=["SnapKV(window_size=8)"], ratios=LEADERBOARD_RATIOS,
                     modes=["query-agnostic"], limit=1, data_dir=tmp_path)
    agnostic = table[table["mode"] == "query-agnostic"].set_index("ratio")
    context = int(table.context_tokens.iloc[0])
    assert list(agnostic.index) == LEADERBOARD_RATIOS
    assert agnostic.kept_tokens[0.875] == int(0.125 * context)  # kvpress's ratio: the share removed
    assert 0.875 in set(leaderboard(table, n_boot=0).ratio) and middle_budget(table) == 0.75
    assert leaderboard_figure(table, tmp_path / "board")[0].is_file()

    ruler = table.assign(dataset="ruler", task="niah_single_1", length=4096)  # the toy's rows, as RULER's
    export_kvpress(ruler, tmp_path / "kvpress")
    [folder] = (tmp_path / "kvpress").glob("ruler__4096__*SnapKV(window_size=8)__0.88")  # a random model has no name
    assert yaml.safe_load((folder / "config.yaml").read_text())["compression_ratio"] == 0.875
    assert sorted(read_kvpress(tmp_path / "kvpress").ratio.unique()) == [0.0, *LEADERBOARD_RATIOS]


def test_a_run_of_kvpress_own_ruler_rows_exports_at_its_length(run, tmp_path):
    """`--dataset ruler-hub` answers kvpress's own rows (simonjegou/ruler): its table keeps the length in the spec
    alone, and its folders are kvpress's "ruler" at that length."""
    hub = run.assign(dataset="ruler-hub", length=pd.array([pd.NA] * len(run), dtype="Int64"),
                     spec=run.spec.map(lambda s: json.dumps(dict(json.loads(s), dataset="ruler-hub"))))
    export_kvpress(hub, tmp_path)
    back = read_kvpress(tmp_path)
    assert set(back.dataset) == {"ruler"} and set(back.length) == {4096}
    assert len(back) == len(read_kvpress(tmp_path).drop_duplicates(["task", "policy", "ratio", "mode"]))
