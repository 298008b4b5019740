"""The README's picture of the explorer: a real SmolLM2 chat turn over an essay, SnapKV's kept strip on one head.

    python scripts/explorer_picture.py [--out figures/explorer.png]

Captures the run (about a minute on 2 CPU cores), opens it in `snapkv_lab.explore` with SnapKV's kept positions, the
observation window, the sinks and the question as a span, exports the view as offline HTML (`Explorer.to_html`)
and photographs that page in headless Chromium (playwright, as the browser tests use it). Not a figure set: it
comes from a capture, not from the tables in data/.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

LAYER, HEAD, CAPACITY = 14, 3, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="figures/explorer.png")
    out = Path(parser.parse_args().out)

    from playwright.sync_api import sync_playwright

    import snapkv_lab as sl
    from snapkv_lab.core.tokens import encode
    from snapkv_lab.tasks.corpus import paul_graham_essays

    model, tokenizer = sl.load_model()
    essay = paul_graham_essays()["founders"][:6000]
    question = "\n\nWhat is the main advice?"
    prompt = [{"role": "user", "content": essay + question}]
    trace = sl.capture(model, tokenizer, prompt, max_new_tokens=32)
    run = sl.generate(model, tokenizer, prompt, policy=sl.SnapKV(capacity=CAPACITY), max_new_tokens=32)
    asked = len(encode(tokenizer, question)) + 5  # the question and the chat template's end of turn, roughly
    view = sl.explore(trace, layer=LAYER, head=HEAD, kept=run,
                      spans={"question": (trace.prompt_len - asked, trace.prompt_len)})
    with tempfile.TemporaryDirectory() as folder:
        page_path = view.to_html(Path(folder) / "explorer.html")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium",
                                                 args=["--no-sandbox", "--headless", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 900, "height": 900})
            page.goto(page_path.as_uri())
            page.wait_for_selector(".main-svg .hm, .main-svg image", timeout=60_000)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.locator(".main-svg").first.screenshot(path=str(out))
            browser.close()
    print(f"{out}: {trace.prompt_len}-token prompt, layer {LAYER} head {HEAD}, SnapKV@{CAPACITY}; answer {run.text!r}")


if __name__ == "__main__":
    main()
