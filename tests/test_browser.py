"""What a researcher sees, checked in a real browser: Debian's Chromium driven by Playwright for Python.

- Notebook 01 (small settings) runs in JupyterLab on 127.0.0.1: no cell errors, the explorer's map is drawn,
  picking another layer redraws it (its title changes), a drag zooms it to exact values with the tokens on the
  axes, and a click on a row opens that token's spotlight.
- An explorer's offline HTML export renders from disk with the network blocked, and its zoom buttons work.
- Every committed HTML figure renders from disk with the network blocked (plotly.js beside the pages).
- The kept-token view, rendered, shows every digit of a highlighted needle, uncovered, inside one box.

Playwright cannot download its own browsers here, so it launches the system Chromium (`executable_path`);
scripts/install.sh installs it where apt-get is available. Without Chromium or Playwright the tests skip and
say what to install. A few minutes at most: JupyterLab starts in seconds, the notebook runs with
SNAPKV_LAB_SMALL=1 as in test_notebooks.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.browser


def chromium_path() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def missing(reason: str):
    """Skip, or fail where a browser is required (.ci/run sets SNAPKV_LAB_REQUIRE_BROWSER=1: CI installs one)."""
    if os.environ.get("SNAPKV_LAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (SNAPKV_LAB_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright import sync_api
    except ImportError:
        missing("playwright is not installed: pip install -e '.[dev]'")
    executable = chromium_path()
    if executable is None:
        missing("no Chromium found (/usr/bin/chromium): install it with `apt-get install chromium`, "
                "as scripts/install.sh does where apt-get is available")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def offline_page(browser):
    """A page that may load file:// URLs only: any other request is aborted."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    blocked = []

    def route(request_route):
        if request_route.request.url.startswith("file:"):
            request_route.continue_()
        else:
            blocked.append(request_route.request.url)
            request_route.abort()

    page.route("**/*", route)
    return page, blocked


TABS = 3  # figures loading at once: each tab's renderer parses plotly.js on its own core while the others wait


def test_html_figures_render_from_disk_offline(browser):
    pages = sorted((ROOT / "figures").glob("**/*.html"))  # a model's folder loads ../plotly.min.js
    assert pages, "no HTML figures in figures/"
    tabs, errors = [offline_page(browser) for _ in range(TABS)], []
    for page, _ in tabs:
        page.on("pageerror", lambda error: errors.append(str(error)))
    for first in range(0, len(pages), TABS):
        batch = list(zip([page for page, _ in tabs], pages[first:first + TABS]))
        for page, path in batch:  # every tab of the batch loads at once
            page.goto(path.as_uri(), wait_until="commit")
        for page, path in batch:
            page.wait_for_selector(".main-svg", timeout=20_000)  # drawn by plotly.js, which came from disk
            page.wait_for_load_state("load")  # as goto waits by default: its errors are heard before the next page
            drawn = page.evaluate("document.querySelectorAll('.main-svg .trace, .main-svg .hm, .main-svg image')"
                                  ".length")
            assert drawn > 0, f"{path.name}: plotly drew no data"
    blocked = [url for _, tab_blocked in tabs for url in tab_blocked]
    for page, _ in tabs:
        page.close()
    assert blocked == [] and errors == [], (blocked, errors)


def test_kept_view_digits_are_drawn_uncovered(browser):
    """Rendered, each digit of a highlighted needle is the topmost element at its own centre (nothing paints over
    it) and lies inside the one highlight box."""
    import torch
    from conftest import ByteTokenizer

    from snapkv_lab.compression.compare import kept_tokens_html

    text = "Some essay text before it. The special magic number is: 9935848. And the essay goes on after it." * 3
    value = text.index("9935848")
    kept = [torch.tensor([[[0, 1, value + 1, value + 2], [0, value, value + 5, 90]]])]  # some digits kept, some not
    page = browser.new_page(viewport={"width": 500, "height": 800})  # narrow: the text wraps over several lines
    page.set_content(kept_tokens_html(ByteTokenizer(), torch.tensor(list(text.encode())), kept,
                                      highlight=(value, value + 7)))
    report = page.evaluate("""() => {
        const box = document.querySelector('.highlight').getBoundingClientRect();
        return [...document.querySelectorAll('.highlight > span')].map(span => {
            const r = span.getBoundingClientRect();
            const top = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);
            return {text: span.textContent, topmost: top === span || span.contains(top),
                    inside: r.left >= box.left && r.right <= box.right && r.top >= box.top && r.bottom <= box.bottom};
        });
    }""")
    page.close()
    assert "".join(r["text"] for r in report) == "9935848"
    assert all(r["topmost"] and r["inside"] for r in report), report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab on 127.0.0.1 (free port, no token) serving a folder with a copy of notebook 01; its kernels run
    this checkout with SNAPKV_LAB_SMALL=1. Every file Jupyter writes goes under tmp_path."""
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "01_attention_maps.ipynb", root)
    state = tmp_path / "jupyter"
    env = {**os.environ, "SNAPKV_LAB_SMALL": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JUPYTER_RUNTIME_DIR": str(state / "runtime"), "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"),
           "JUPYTERLAB_SETTINGS_DIR": str(state / "settings"), "IPYTHONDIR": str(state / "ipython")}
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--ServerApp.port_retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
         "--ServerApp.allow_root=True", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "jupyterlab.log", "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield url
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


# JupyterLab's application object (exposed by --LabApp.expose_app_in_browser): the open notebook's cells as JSON.
CELLS = "() => window.jupyterapp.shell.currentWidget.content.widgets.map(cell => cell.model.toJSON())"


@pytest.mark.notebook
@pytest.mark.slow
def test_notebook_01_in_jupyterlab(browser, jupyterlab):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{jupyterlab}/lab/tree/01_attention_maps.ipynb")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                           timeout=120_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # Done when the kernel is idle and every code cell ran, or one raised (the run stops there; later cells keep
    # no execution count).
    page.wait_for_function(f"""() => {{
        const code = ({CELLS})().filter(c => c.cell_type === 'code');
        const finished = code.every(c => c.execution_count !== null)
            || code.some(c => c.outputs.some(o => o.output_type === 'error'));
        return finished && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle';
    }}""", timeout=300_000, polling=1000)
    cells = page.evaluate(CELLS)
    errors = [f"{o['ename']}: {o['evalue']}" for c in cells if c["cell_type"] == "code" for o in c["outputs"]
              if o["output_type"] == "error"]
    assert errors == []
    assert all(c["execution_count"] for c in cells if c["cell_type"] == "code")

    page.wait_for_selector(".jp-OutputArea .main-svg", timeout=180_000)  # the plotly heatmap, drawn
    explorer = page.locator(".jp-OutputArea .widget-vbox").filter(has=page.locator(".main-svg")).first
    title = explorer.locator(".gtitle")
    title.wait_for(timeout=180_000)
    before = title.text_content()
    assert before.startswith("layer 14, head 3"), before  # the explorer starts at the notebook's map
    explorer.locator(".widget-dropdown", has_text="layer").locator("select").select_option(label="0")
    wait_for_title(page, title, lambda text: text.startswith("layer 0, head 3"), "picking layer 0")

    # The notebook's cells zoomed this explorer from Python: back to the overview, then drag a small rectangle on
    # the map: the view zooms to it, exact, with the tokens' text on the axes.
    explorer.locator("button", has_text="overview").click()
    wait_for_title(page, title, lambda text: "rows 0-" in text, "the overview button")
    drag_layer = explorer.locator(".nsewdrag").first
    drag_layer.scroll_into_view_if_needed()  # the mouse acts on what is on screen
    box = drag_layer.bounding_box()
    page.mouse.move(box["x"] + 0.70 * box["width"], box["y"] + 0.70 * box["height"])
    page.mouse.down()
    page.mouse.move(box["x"] + 0.74 * box["width"], box["y"] + 0.74 * box["height"], steps=8)
    page.mouse.up()
    zoomed = wait_for_title(page, title, lambda text: "rows 0-" not in text and "(exact)" in text, "a drag on the map")
    labels = explorer.locator(".xtick text").all_text_contents()
    assert 0 < len(labels) <= 64 and all(label.split(" ")[0].isdigit() for label in labels), labels
    assert any(len(label.split(" ", 1)) == 2 for label in labels), labels  # "<position> <token text>"

    # A click on a row opens its spotlight beside the map (the notebook opened another row's from Python).
    spotlight = explorer.locator(".widget-html", has_text="over the prompt").first
    before = spotlight.text_content()
    drag_layer.scroll_into_view_if_needed()
    box = drag_layer.bounding_box()
    page.mouse.click(box["x"] + 0.5 * box["width"], box["y"] + 0.5 * box["height"])
    deadline = time.monotonic() + 60
    while spotlight.text_content() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert spotlight.text_content() != before, f"a click on the zoomed map ({zoomed!r}) opened no other spotlight"
    page.close()


def wait_for_title(page, title, accept, action: str) -> str:
    """Wait until the explorer's title passes `accept` (a redraw by the kernel); return it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = title.text_content()
        if accept(text):
            return text
        time.sleep(0.5)
    pytest.fail(f"{action} did not redraw the explorer: its title is still {title.text_content()!r}")


def test_trace_view_export_renders_offline(browser, tmp_path):
    """explore(...).to_html: one file, plotly.js inlined; its buttons switch between the overview and the zooms."""
    import torch
    from conftest import ByteTokenizer, make_tiny_llama

    from snapkv_lab import capture, explore

    trace = capture(make_tiny_llama(), ByteTokenizer(), torch.arange(600) % 240 + 3, max_new_tokens=4,
                    stop_at_eos=False, progress=False)
    path = explore(trace, layer=1, head=0, max_cells=128, progress=False).to_html(tmp_path / "view.html")
    page, blocked = offline_page(browser)
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    page.wait_for_selector(".main-svg .hm, .main-svg image", timeout=20_000)
    title = page.locator(".gtitle").first
    assert "max over 8 x 8-token blocks" in title.text_content()
    buttons = page.locator(".updatemenu-button")
    assert buttons.count() >= 3
    buttons.nth(buttons.count() - 1).click()  # the deepest zoom: exact, labelled
    page.wait_for_function("() => document.querySelector('.gtitle').textContent.includes('(exact)')", timeout=20_000)
    assert page.locator(".xtick text").count() > 0
    page.close()
    assert blocked == [] and errors == [], (blocked, errors)
