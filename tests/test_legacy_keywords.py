"""Keywords renamed on 2026-11-26 (the findings' windows became segments) still work: each old name gives the same
result as its new name and warns (DeprecationWarning); old and new name together are refused; every public function
taking one of the renamed options takes its old name too (findings.legacy.OPTIONS)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pandas as pd
import pytest
import torch
from conftest import ByteTokenizer, make_tiny_llama

import snapkv_lab.findings
from snapkv_lab import capture
from snapkv_lab.core.moved import renamed
from snapkv_lab.core.overlap import coarse_overlap, selection_vs_generation
from snapkv_lab.findings import experiments
from snapkv_lab.findings.experiments import generation_consistency, prompt_segments, prompt_windows, run_findings
from snapkv_lab.findings.legacy import COLUMNS, OPTIONS


@pytest.fixture(scope="module")
def trace():
    """A greedy trace of a 200-token prompt on a tiny Llama (24 new tokens)."""
    prompt = torch.arange(3, 203)
    return capture(make_tiny_llama(), ByteTokenizer(), prompt, max_new_tokens=24, stop_at_eos=False, progress=False)


def scored():
    """Attention of 20 generated rows over a 60-token prefix (3 heads), the voters' attention, two selections and
    the sinks: selection_vs_generation's inputs."""
    generator = torch.Generator().manual_seed(0)
    dirichlet = torch.distributions.Dirichlet(torch.full((65,), 0.1))
    attn, observed = dirichlet.sample((3, 20))[..., :60], dirichlet.sample((3, 7))[..., :60]
    selections = {name: torch.rand(3, 60, generator=generator) < 0.2 for name in ("x", "y")}
    return attn, observed, selections, torch.rand(3, 60, generator=generator) < 0.1


def same(old, new) -> None:
    if isinstance(old, pd.DataFrame):
        pd.testing.assert_frame_equal(old, new)
    elif isinstance(old, dict):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    else:
        assert old == new


# (function, its arguments, old keywords, the same under today's names)
CASES = {
    "generation_consistency": (generation_consistency, dict(obs_window=8), dict(gen_window=8, n_gen_windows=2),
                               dict(gen_segment=8, n_gen_segments=2)),
    "prompt_segments": (prompt_segments, {}, dict(window=16, n_windows=3), dict(segment=16, n_prompt_segments=3)),
}


@pytest.mark.parametrize("name", CASES)
def test_an_old_keyword_gives_the_same_table_and_warns(trace, name):
    function, common, old, new = CASES[name]
    with pytest.warns(DeprecationWarning) as caught:
        before = function(trace, **common, **old)
    said = [str(w.message) for w in caught]
    for old_name, new_name in zip(old, new):
        assert f"{name}(): the keyword {old_name!r} is now named {new_name!r} (since 2026-11-26)" in said
    same(before, function(trace, **common, **new))


@pytest.mark.parametrize("name", CASES)
def test_an_old_and_a_new_name_together_are_refused(trace, name):
    function, common, old, new = CASES[name]
    first_old, first_new = next(iter(old)), next(iter(new))
    with pytest.raises(TypeError, match=f"got both '{first_old}' and '{first_new}'"):
        function(trace, **common, **{first_old: old[first_old], first_new: new[first_new]})


def test_prompt_windows_is_prompt_segments_under_its_old_name(trace):
    with pytest.warns(DeprecationWarning, match="prompt_windows is now named prompt_segments"):
        before = prompt_windows(trace, window=16, n_windows=3)
    same(before, prompt_segments(trace, segment=16, n_prompt_segments=3))


def test_the_overlap_measures_take_their_old_keywords():
    attn, observed, selections, sinks = scored()
    segments = {1: slice(0, 8), 2: slice(8, 20)}
    with pytest.warns(DeprecationWarning, match="'windows' is now named 'segments'"):
        before = selection_vs_generation(attn, selections, sinks=sinks, windows=segments, observed=observed, layer=3)
    assert before == selection_vs_generation(attn, selections, sinks=sinks, segments=segments, observed=observed,
                                             layer=3)
    with pytest.raises(TypeError, match="got both 'windows' and 'segments'"):
        selection_vs_generation(attn, selections, sinks=sinks, windows=segments, segments=segments)
    with pytest.warns(DeprecationWarning, match="'attn_window' is now named 'attn_voters'"):
        before = coarse_overlap(attn, attn_window=observed)
    same(before, coarse_overlap(attn, observed))


class Reached(Exception):
    """Raised where run_findings has read its options, to stop it before any model runs."""


def test_run_findings_takes_the_old_option_names_as_keywords(monkeypatch, tmp_path):
    seen = []

    def options(given: dict) -> dict:
        seen.append(given)
        raise Reached

    monkeypatch.setattr(experiments, "_options", options)
    with pytest.warns(DeprecationWarning, match="'gen_window' is now named 'gen_segment'"), pytest.raises(Reached):
        run_findings(data_dir=tmp_path, gen_window=8, n_windows=5)
    assert seen == [dict(gen_segment=8, n_prompt_segments=5)]
    with pytest.raises(TypeError, match="got both 'prompt_window' and 'prompt_segment'"):
        run_findings(data_dir=tmp_path, prompt_window=8, prompt_segment=16)


def test_only_the_renames_a_function_takes_apply():
    @renamed("2026-11-26", **OPTIONS)
    def segments(*, gen_segment=1):
        return gen_segment

    with pytest.warns(DeprecationWarning):
        assert segments(gen_window=3) == 3
    with pytest.raises(TypeError, match="unexpected keyword argument 'prompt_window'"):
        segments(prompt_window=3)  # the function never took a prompt segment: Python's own refusal


# Where the renamed keywords live: every findings module, and the measures they score with.
FINDINGS_MODULES = [f"snapkv_lab.findings.{m.name}" for m in pkgutil.iter_modules(snapkv_lab.findings.__path__)]


@pytest.mark.parametrize("module", [*FINDINGS_MODULES, "snapkv_lab.core.overlap"])
def test_every_public_function_taking_a_renamed_keyword_takes_its_old_name(module):
    """A function added later with one of today's names is caught here if it forgets the old name."""
    renamed_to = {*OPTIONS.values(), *COLUMNS.values(), "segments", "attn_voters"}
    loaded = importlib.import_module(module)
    for name, function in inspect.getmembers(loaded, inspect.isfunction):
        if name.startswith("_") or function.__module__ != module:
            continue
        if renamed_to & set(inspect.signature(function).parameters):
            assert hasattr(function, "__wrapped__"), f"{module}.{name} takes a renamed keyword without its old name"


def test_a_policy_takes_window_size_as_it_meant_before_the_kept_tail_had_its_name():
    """Before 2026-11-26 `window_size` named the last tokens every policy keeps by right; it stays SnapKV's family's
    observation window, and elsewhere reads as kept_tail, warning; a wrapper's was its inner policy's window, as the
    stored configs read (policies.upgrade_config)."""
    import warnings

    from snapkv_lab import POLICIES

    for name in ("TOVA", "H2O", "StreamingLLM", "KNorm", "KVzip"):
        with pytest.warns(DeprecationWarning, match="now named 'kept_tail'"):
            old = POLICIES[name](window_size=16)
        assert old == POLICIES[name](kept_tail=16)
    with pytest.warns(DeprecationWarning, match="now named 'kept_tail'"):
        wrapped = POLICIES["AdaKV"](window_size=64)
    assert wrapped == POLICIES["AdaKV"](policy=POLICIES["SnapKV"](window_size=64))
    with pytest.warns(DeprecationWarning):
        over_knorm = POLICIES["AdaKV"](policy=POLICIES["KNorm"](), window_size=8)
    assert over_knorm.policy.kept_tail == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's name on SnapKV's family: no warning
        assert POLICIES["SnapKV"](window_size=64).window_size == 64
    with pytest.raises(TypeError, match="both 'window_size' and 'kept_tail'"), pytest.warns(DeprecationWarning):
        POLICIES["TOVA"](window_size=4, kept_tail=8)
