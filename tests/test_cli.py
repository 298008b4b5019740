"""The command line: one table of commands, the same under its three entry points, light to ask for help."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snapkv_lab.app.cli import build_parser, main
from snapkv_lab.app.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"convert", "figures", "needle", "eval", "scorer-allocation"}
ENTRY_POINTS = {"console script": ["snapkv-lab"], "package": [sys.executable, "-m", "snapkv_lab"],
                "module": [sys.executable, "-m", "snapkv_lab.cli"]}


def run(argv: list[str]) -> subprocess.CompletedProcess:
    # This checkout's package, whichever one the environment installed.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_the_table_holds_every_command():
    assert set(COMMANDS) == NAMES


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_help_lists_every_command(entry):
    if entry == "console script" and shutil.which("snapkv-lab") is None:
        pytest.skip("snapkv-lab is not installed (pip install -e .)")
    result = run([*ENTRY_POINTS[entry], "--help"])
    assert result.returncode == 0, result.stderr
    listed = result.stdout.split("positional arguments:")[1]
    for name in NAMES:
        assert f"\n    {name} " in listed, (name, result.stdout)


def test_help_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom snapkv_lab.cli import main\n"
            f"for argv in [['--help']] + [[name, '--help'] for name in {sorted(NAMES)!r}]:\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stderr
    assert result.stdout.count("usage: snapkv-lab") == 1 + len(NAMES)


def test_version_and_what_the_tool_does(capsys):
    from snapkv_lab import __version__

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"snapkv-lab {__version__}"
    text = build_parser().format_help()
    assert "attention" in text and "SnapKV" in text and "--version" in text


def test_figures_help_lists_the_figure_sets_and_what_recompute_skips():
    from snapkv_lab.app.figure_sets import FIGURE_MODULES, load_figure_sets

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = {a.dest: a for a in subparsers.choices["figures"]._actions}
    assert list(options["only"].choices) == list(FIGURE_MODULES)
    assert set(FIGURE_MODULES) == set(load_figure_sets())  # the table names every registered set
    assert all(name in options["only"].help for name in FIGURE_MODULES)
    assert "needle grid" in options["recompute"].help and "--only pressure" in options["recompute"].help
    with pytest.raises(SystemExit):
        main(["figures", "--only", "nope"])


def test_every_option_has_a_help_string():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subparsers.choices.items():
        for action in parser._actions:
            assert action.help, (name, action.option_strings)


def test_figures_and_needle_pass_their_options_on(monkeypatch, tmp_path):
    import snapkv_lab.figures
    import snapkv_lab.models
    import snapkv_lab.pressure

    calls = []
    monkeypatch.setattr(snapkv_lab.figures, "make_figures", lambda *a, **k: calls.append(("draw", a, k)) or [])
    monkeypatch.setattr(snapkv_lab.pressure, "recompute", lambda options: calls.append(("needle", options)))
    monkeypatch.setattr(snapkv_lab.models, "check_model", lambda name: calls.append(("check", name)))
    assert main(["figures", "--recompute", "--only", "findings", "--samples", "1", "--split", "heldout",
                 "--data-dir", str(tmp_path)]) == 0
    # tables kept apart are drawn apart: figures in <data-dir>/figures, not over the repository's figures/
    assert calls.pop() == ("draw", (str(tmp_path), tmp_path / "figures"), dict(
        recompute=True, only=["findings"], options=dict(model=None, framing=None, samples=1, reuse=False,
                                                        obs_window=None, prompt_segment=None,
                                                        gen_segment=None, split="heldout",
                                                        executor="local", ray_address=None, cpus_per_worker=None)))
    assert calls.pop() == ("check", None)
    assert main(["needle", "--model", "some/model", "--lengths", "1000", "--depths", "0.5", "--skip-lines",
                 "--suites", "needle", "ruler", "--framing", "plain"]) == 0
    # another model than the default writes its own folder: data/<model>/ (a hub id's "/" as "--")
    assert calls == [("check", "some/model"),
                     ("needle", dict(data_dir=Path("data") / "some--model", model="some/model", framing="plain",
                                     samples=None, first_sample=0, lengths=[1000],
                                     depths=[0.5], skip_lines=True, lines_lengths=None, suites=["needle", "ruler"],
                                     policies=None, capacities=None, modes=None, executor="local", ray_address=None,
                                     cpus_per_worker=None)),
                     ("draw", ("data", Path("figures")), dict(only=["pressure"], options=dict(model="some/model")))]


def test_needle_without_suites_runs_the_grid_its_options_describe_and_names_the_others(monkeypatch, capsys):
    import snapkv_lab.figures
    import snapkv_lab.pressure

    ran = []
    monkeypatch.setattr(snapkv_lab.figures, "make_figures", lambda *a, **k: [])
    monkeypatch.setattr(snapkv_lab.pressure, "recompute", ran.append)
    assert main(["needle", "--lengths", "1000", "--policies", "SnapKV", "AdaKV(SnapKV(window_size=16))",
                 "--capacities", "256"]) == 0
    assert ran[0]["suites"] == ["needle"]
    err = capsys.readouterr().err
    assert all(name in err for name in snapkv_lab.pressure.SUITES if name != "needle") and "--suites" in err
    (cells,) = snapkv_lab.pressure.grid_cells(ran[0]).values()  # a wrapped policy with settings is a grid policy
    assert [p["name"] for p in cells[0].config["policies"]] == ["SnapKV", "AdaKV"]
    assert cells[0].config["policies"][1]["policy"]["window_size"] == 16 and cells[0].config["capacities"] == [256]


def refused(args, capsys) -> str:
    """What the parser says refusing `args` (exit status 2, before any run function starts)."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_needle_refuses_bad_grid_options_before_any_model_runs(monkeypatch, capsys):
    import snapkv_lab.pressure

    monkeypatch.setattr(snapkv_lab.pressure, "recompute", lambda options: pytest.fail("the grid ran"))
    err = refused(["needle", "--policies", "SnapKV", "SnapKv"], capsys)
    assert "unknown policy 'SnapKv'" in err and ", ".join(snapkv_lab.POLICIES) in err  # the names to choose from
    assert "not a positive integer" in refused(["needle", "--capacities", "-5"], capsys)
    assert "is not in [0, 1]" in refused(["needle", "--depths", "1.5"], capsys)
    assert main(["needle", "--policies", "FullCache"]) == 2
    assert "baseline" in capsys.readouterr().err
    assert main(["needle", "--capacities", "16"]) == 2  # below the 32-token observation window
    assert "window_size (32) must be smaller than capacity (16)" in capsys.readouterr().err
    assert main(["needle", "--suites", "needles"]) == 2
    assert ", ".join(snapkv_lab.pressure.SUITES) in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert main(["needle", "--executor", "ray"]) == 2
    assert "pip install 'snapkv_lab[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize("args, said", [
    (["needle", "--policies", "NoSuchPolicy"], "unknown policy 'NoSuchPolicy'"),
    (["needle", "--capacities", "-5"], "-5 is not a positive integer"),
    (["eval", "--policies", "AdaKV(NoSuch)"], "unknown policy 'NoSuch'"),
    (["eval", "--ratios", "1.5"], "share of KV pairs removed"),
    (["needle", "--model", "nobody/no-such-model"], "cannot load model 'nobody/no-such-model'"),
    (["eval", "--model", "."], "the folder has no config.json"),
    (["eval", "--export", "csv", "out"], "--export csv: the formats are kvpress"),
    (["eval", "--import", "no/such"], "--import no/such: no such folder of kvpress results"),
    (["eval", "--reuse", "no_such.csv"], "--reuse no_such.csv: no such table"),
])
def test_bad_options_and_models_are_one_line_in_a_second_without_torch(args, said, tmp_path):
    """As a newcomer runs it: a fresh process, offline, an empty hub cache. The refusal is one line (argparse's own
    too, without its usage), exit status 2, and torch is never imported (the seconds it costs)."""
    import os
    import time

    code = ("import sys\nfrom snapkv_lab.cli import main\n"
            f"try:\n    status = main({args!r})\nexcept SystemExit as exit:\n    status = exit.code\n"
            "print('heavy:', [m for m in ('torch', 'transformers') if m in sys.modules], 'status:', status)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert time.perf_counter() - began < 10
    assert "heavy: [] status: 2" in result.stdout, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("snapkv-lab")]
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in result.stderr
    assert "usage:" not in result.stderr, result.stderr


def test_figures_from_a_folder_without_tables_says_where_they_are_and_asks_for_no_model(tmp_path, capsys):
    """Run outside the repository, a redraw would write nothing: it says so (exit 2) instead of "0 files written".
    A plain redraw loads no model, so another model's name is not checked, only its tables looked for."""
    args = ["figures", "--data-dir", str(tmp_path / "data"), "--figures-dir", str(tmp_path / "figures")]
    assert main([*args, "--model", "nobody/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "holds no tables" in err and "--data-dir" in err and "cannot load model" not in err
    assert not (tmp_path / "figures").exists()


def test_figures_samples_by_task_grow_the_leaderboard_alone_and_anything_else_is_refused(monkeypatch, tmp_path, capsys):
    import snapkv_lab.figures
    import snapkv_lab.models

    calls = []
    monkeypatch.setattr(snapkv_lab.figures, "make_figures", lambda *a, **k: calls.append(k["options"]["samples"]) or [])
    monkeypatch.setattr(snapkv_lab.models, "check_model", lambda name: None)
    args = ["figures", "--recompute", "--data-dir", str(tmp_path), "--only"]
    assert main([*args, "eval", "--reuse", "--samples", "niah_single_1=10", "niah_multivalue=5"]) == 0
    assert calls == [{"niah_single_1": 10, "niah_multivalue": 5}]
    for refused, said in ((["findings", "--samples", "niah_single_1=10"], "needs --only eval"),
                          (["eval", "findings", "--samples", "vt=4"], "needs --only eval"),
                          (["eval", "--samples", "3", "vt=4"], "not both"),
                          (["eval", "--samples", "3", "4"], "one number or TASK=N entries"),
                          (["eval", "--samples", "vt=3", "vt=4"], "names a task twice")):
        assert main([*args, *refused]) == 2
        assert said in capsys.readouterr().err
    for bad in ("=4", "vt=0", "vt=x"):
        with pytest.raises(SystemExit):
            main([*args, "eval", "--samples", bad])
    assert calls == [{"niah_single_1": 10, "niah_multivalue": 5}]


def test_ray_options_without_the_ray_executor_are_refused_before_anything_runs(monkeypatch, capsys):
    import snapkv_lab.models

    monkeypatch.setattr(snapkv_lab.models, "check_model", lambda name: pytest.fail("a model was looked at"))
    for command in (["eval", "--tasks", "niah_single_1"], ["needle"], ["figures", "--recompute"]):
        assert main([*command, "--cpus-per-worker", "1"]) == 2
        assert ("cpus_per_worker (--cpus-per-worker) is only used with executor='ray' (--executor ray)"
                in capsys.readouterr().err)
    assert main(["needle", "--ray-address", "auto", "--cpus-per-worker", "2"]) == 2
    assert "--ray-address) and cpus_per_worker (--cpus-per-worker) are only used with" in capsys.readouterr().err


def test_figures_without_ray_says_how_to_install_it_before_any_model_runs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert main(["figures", "--recompute", "--only", "findings", "--executor", "ray", "--data-dir", "nowhere"]) == 2
    assert "pip install 'snapkv_lab[ray]'" in capsys.readouterr().err


def test_eval_takes_all_for_every_policy_and_refuses_a_misspelt_one(tmp_path, capsys):
    from snapkv_lab.app.cli import main

    assert main(["eval", "--data-dir", str(tmp_path), "--policies", "all", "--tasks", "niah"]) == 2
    assert "unknown tasks ['niah']" in capsys.readouterr().err  # "all" passed the parser; the task stopped the run
    with pytest.raises(SystemExit):
        main(["eval", "--data-dir", str(tmp_path), "--policies", "Al"])
    assert "unknown policy 'Al'" in capsys.readouterr().err


@pytest.mark.parametrize("options, said", [
    (["--tasks", "niah"], "unknown tasks ['niah']"),
    (["--ratios", "0.5", "--capacities", "64"], "not both"),
    (["--dataset", "nope"], "unknown dataset 'nope'"),
])
def test_eval_refuses_bad_options_before_any_model_loads(options, said, tmp_path, capsys):
    from snapkv_lab.app.cli import main

    assert main(["eval", "--data-dir", str(tmp_path), *options]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "cells").exists()


def fresh_run(args: list[str], tmp_path) -> tuple[str, list[str]]:
    """`main(args)` in a fresh process, offline, as a newcomer runs it: its stdout (exit status and the heavy modules
    it imported) and the lines of stderr the command wrote (argparse's usage aside)."""
    code = ("import sys\nfrom snapkv_lab.cli import main\n"
            f"try:\n    status = main({args!r})\nexcept SystemExit as exit:\n    status = exit.code\n"
            "print('heavy:', [m for m in ('torch', 'transformers') if m in sys.modules], 'status:', status)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout, [line for line in result.stderr.splitlines() if line.startswith("snapkv-lab")]


@pytest.mark.parametrize("args, said, suggested", [
    (["eval", "--tasks", "vtt"], "unknown tasks ['vtt'] for ['ruler']", "did you mean vt?"),
    (["eval", "--dataset", "longbench", "--tasks", "Qasper", "narative_qa"], "unknown tasks ['Qasper', 'narative_qa']",
     "did you mean qasper for 'Qasper', narrativeqa for 'narative_qa'?"),
    (["eval", "--dataset", "LongBench"], "unknown dataset 'LongBench'", "did you mean longbench?"),
    (["eval", "--policies", "snapkv"], "unknown policy 'snapkv'", "did you mean SnapKV?"),
    (["needle", "--policies", "AdaKV(snapkv)"], "unknown policy 'snapkv'", "did you mean SnapKV?"),
    (["needle", "--suites", "needles"], "unknown suites ['needles']", "did you mean needle?"),
    (["figures", "--only", "finding"], "unknown figure sets ['finding']", "did you mean findings?"),
    (["figures", "--recompute", "--only", "eval", "--samples", "niah_single_11=3"], "unknown tasks ['niah_single_11']",
     "did you mean niah_single_1?"),
])
def test_a_misspelt_name_is_one_line_with_the_closest_name_and_no_torch(args, said, suggested, tmp_path):
    """Every name the command line refuses (policy, dataset, task, suite, figure set) is refused before torch is
    imported, in one line that names the closest known name, case aside."""
    out, lines = fresh_run(args, tmp_path)
    assert "heavy: [] status: 2" in out
    assert len(lines) == 1 and said in lines[0] and suggested in lines[0], lines


def test_a_name_with_nothing_close_gets_no_suggestion(tmp_path):
    out, lines = fresh_run(["eval", "--tasks", "niah"], tmp_path)
    assert "heavy: [] status: 2" in out and len(lines) == 1
    assert "unknown tasks ['niah']" in lines[0] and "did you mean" not in lines[0] and "niah_single_1" in lines[0]


def test_the_name_tables_are_the_registries():
    """app.catalog copies the names of registries that import torch, so that the command line checks names without
    them: the copies must be the registries' names, in their order."""
    from snapkv_lab.app.catalog import DATASET_TASKS, LEADERBOARD_DATASETS, SUITE_NAMES
    from snapkv_lab.evaluation import DATASETS, LEADERBOARD
    from snapkv_lab.pressure import SUITES

    assert DATASET_TASKS == {name: tuple(benchmark.tasks) for name, benchmark in DATASETS.items()}
    assert list(DATASET_TASKS) == list(DATASETS)
    assert LEADERBOARD_DATASETS == tuple(LEADERBOARD["datasets"])
    assert SUITE_NAMES == tuple(SUITES)


def test_the_library_refuses_the_same_names_the_same_way():
    """The registries' own checks (eval_cells, grid_cells, make_figures, policy_spec) give the command line's message,
    closest name included."""
    from snapkv_lab.app.figure_sets import make_figures
    from snapkv_lab.evaluation import eval_cells
    from snapkv_lab.policies import policy_spec
    from snapkv_lab.pressure import grid_cells

    with pytest.raises(ValueError, match=r"unknown tasks \['vtt'\] for \['ruler'\] \(did you mean vt\?\)"):
        eval_cells(None, ["ruler"], tasks=["vtt"], ratios=[0.5])
    with pytest.raises(ValueError, match=r"unknown dataset 'Ruler' \(did you mean ruler\?\)"):
        eval_cells(None, ["Ruler"], ratios=[0.5])
    with pytest.raises(ValueError, match=r"unknown suites \['Needle'\] \(did you mean needle\?\)"):
        grid_cells(dict(suites=["Needle"]))
    with pytest.raises(ValueError, match=r"unknown figure sets \['Findings'\] \(did you mean findings\?\)"):
        make_figures(only=["Findings"])
    with pytest.raises(ValueError, match=r"unknown policy 'H20' \(did you mean H2O\?\)"):
        policy_spec("H20")


def test_figures_recompute_in_a_new_folder_starts_from_the_packaged_recipes(monkeypatch, tmp_path, capsys):
    """A new --data-dir has no prompt_recipes.json: the run starts from the packaged ones (the repository's
    data/prompt_recipes.json), written into the folder, instead of ending in a traceback."""
    import snapkv_lab.findings.experiments as experiments
    import snapkv_lab.models

    def stop(*args, **kwargs):
        raise ValueError("stopped before any model runs")

    monkeypatch.setattr(snapkv_lab.models, "check_model", lambda name: None)
    monkeypatch.setattr(experiments, "findings_cells", stop)  # the recipes are read: stop before the model
    new = tmp_path / "new"
    assert main(["figures", "--recompute", "--only", "findings", "--data-dir", str(new)]) == 2
    assert capsys.readouterr().err.strip() == "snapkv-lab figures: error: stopped before any model runs"
    assert (new / "prompt_recipes.json").read_bytes() == (ROOT / "data" / "prompt_recipes.json").read_bytes()
