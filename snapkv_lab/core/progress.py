"""Progress bars that read well everywhere: live in a terminal or notebook, plain timestamped lines in a log file.

tqdm redraws its line with carriage returns and cursor escapes; written to a file that becomes thousands of
lines of escape codes. Off a terminal, `bar` writes one plain line at most every `LOG_INTERVAL_S` seconds
and at the end, and transient (leave=False) inner bars stay quiet.
"""

from __future__ import annotations

import io
import re
import sys

LOG_INTERVAL_S = 30.0
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _interactive() -> bool:
    if getattr(sys.stderr, "isatty", lambda: False)():
        return True
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


class _LogLines(io.TextIOBase):
    """A stream that turns tqdm's redraws into whole lines: escapes and carriage returns dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        line = _ESCAPES.sub("", text).replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable=None, *, desc: str = "", total: int | None = None, disable: bool = False, leave: bool = True):
    """A tqdm bar over `iterable` (or updated by hand up to `total`): live when interactive, log lines otherwise."""
    if _interactive():
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, total=total, disable=disable, leave=leave)
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=disable or not leave, leave=leave, file=_LogLines(sys.stderr),
                mininterval=LOG_INTERVAL_S, ascii=True, ncols=100)
