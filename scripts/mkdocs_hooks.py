"""MkDocs hooks for the docs site: the README is the home page, and the repository's figures are published with it.

The pages are also read on GitHub, where figures are linked as ../figures/x.png and the home page is README.md.
Here the README becomes index.md (its links into docs/ rewritten to the site's), and every file under figures/
is added to the site under figures/, with ../figures/ links pointing there, so that a page links a figure once.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for path in sorted((ROOT / "figures").rglob("*")):
        if path.is_file():
            files.append(File(str(path.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    files.append(File.generated(config, "index.md", content=_home_page()))
    return files


def _home_page() -> str:
    text = (ROOT / "README.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)


def on_page_markdown(markdown, page, config, files):
    # a page at the docs root links ../figures/x; on the site the figures sit at figures/x beside it
    return markdown.replace("](../figures/", "](figures/")
