"""Cache entries filled by two processes at once (the suite's two xdist workers on a fresh machine): core.models'
cache_lock makes the second wait for the first, and write_whole never shows a reader part of a file."""

from __future__ import annotations

import subprocess
import sys
import time

from snapkv_lab.core.models import cache_lock, write_whole

HOLDER = """
import sys, time
from pathlib import Path
from snapkv_lab.core.models import cache_lock
with cache_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(1.5)
    Path(sys.argv[1]).write_text("filled by the other process")
"""


def test_a_second_process_waits_for_the_lock_and_finds_the_entry_filled(tmp_path):
    target = tmp_path / "entry"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    start = time.monotonic()
    with cache_lock(target):
        waited = time.monotonic() - start
        assert target.read_text() == "filled by the other process"  # what the waiting side checks before filling
    holder.wait(timeout=30)
    assert waited > 0.5 and holder.returncode == 0


def test_write_whole_replaces_the_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "cache" / "entry.csv"

    def write(tmp):
        assert not path.exists() or path.read_text() == "old"  # the reader's view while the new one is written
        tmp.write_text("new")

    write_whole(path, lambda tmp: tmp.write_text("old"))
    write_whole(path, write)
    assert path.read_text() == "new" and [p.name for p in path.parent.iterdir()] == ["entry.csv"]
