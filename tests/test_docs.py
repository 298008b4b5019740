"""The front door and the docs site: the README stays a five-minute read and its tour runs as written; the docs
build with `mkdocs build --strict` (a broken link, anchor or page, or a docstring the reference cannot render,
fails)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for command in ("bash scripts/install.sh && snapkv-lab figures --recompute",
                    "bash scripts/install.sh && python3 -m pytest -q"):
        assert command in text  # the two commands for a new machine
    pages = set(re.findall(r"\]\((docs/[^)#]+)", text))
    assert {"docs/getting-started.md", "docs/findings.md", "docs/compression.md", "docs/benchmarks.md"} <= pages
    assert all((ROOT / page).exists() for page in pages)
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert images and all((ROOT / image).exists() for image in images)


@pytest.mark.slow
def test_readme_tour_runs_as_written():
    """Every python block of the README, in order, in one namespace, on the bundled SmolLM2."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["trace"].n_generated > 0 and namespace["run"].cache_lengths[0] == 256
    assert set(namespace["table"]["policy"]) == {"FullCache", "SnapKV@256", "KVzip@256"}


def test_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: pip install -e '.[dev]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is in the dev extra: pip install -e '.[dev]'")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    site = tmp_path / "site"
    assert (site / "index.html").exists() and (site / "reference" / "index.html").exists()
    assert (site / "figures" / "findings_b.png").exists()  # the figures travel with the pages that show them
    assert "AttentionTrace" in (site / "reference" / "index.html").read_text()


def test_the_docs_say_what_the_committed_tables_say(tmp_path, monkeypatch):
    """Every generated block of docs/ equals what snapkv_lab.app.docs_tables writes from data/; a hand edit is caught
    and undone by write()."""
    import functools
    import shutil

    from snapkv_lab.app import docs_tables
    from snapkv_lab.findings import report

    # The three passes below read the same data/, which nothing here changes: each block is rendered once (its
    # bootstraps and Holm adjustments are deterministic), not once per pass, and the findings verdicts that two
    # blocks show are computed once.
    monkeypatch.setattr(docs_tables, "rendered", functools.lru_cache(maxsize=None)(docs_tables.rendered))
    monkeypatch.setattr(report, "report", functools.lru_cache(maxsize=None)(report.report))
    assert docs_tables.stale(ROOT / "docs", ROOT / "data") == []
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")  # the README's blocks are written beside docs/
    page = docs / docs_tables.BLOCKS["leaderboard"].page
    page.write_text(page.read_text().replace("| FullCache |", "| FullCache (edited) |", 1))
    assert docs_tables.stale(docs, ROOT / "data") == ["leaderboard"]
    assert docs_tables.write(docs, ROOT / "data") == [page]
    assert page.read_text() == (ROOT / "docs" / docs_tables.BLOCKS["leaderboard"].page).read_text()


def test_every_notebook_opens_with_what_it_needs_and_how_long_it_takes():
    import json

    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert "**Needs:**" in first and "**Time on 2 CPU cores:**" in first, path.name
