"""A lab in JupyterLab, in a real browser: what a reader sees when they work it.

`make lab`'s JupyterLab (on 127.0.0.1, token-protected) serves two copies of the acceptance-rule lab,
one with every solution in place and one whose first task holds a known-wrong block. Headless Chromium
(Debian's, which CI installs), driven by Playwright, opens each, runs all its cells from the Run menu,
and the test asserts what appears in the page: every check's "cases pass" line for the solved copy;
for the wrong one, the check's report with the hint that names the slip. Screenshots land in
_build/screenshots/ beside the site's.
"""
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tools import labs

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "_build" / "screenshots"
LAB = ROOT / "labs" / "10-speculative" / "acceptance-rule.ipynb"
WRONG = "p / q without the min with 1"          # the known-wrong block the second copy holds
PASS_LINES = ["a stays in [0, 1]: 5 cases", "accept_probability: 5 cases pass", "residual: 5 cases pass",
              "speculative_step: 5 cases pass"]

pytestmark = pytest.mark.slow


def _missing(message: str):
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _browser_driver():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed, so JupyterLab was not tested in a browser: "
                 "pip install -r requirements.txt (make env) installs it")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        _missing("Debian's chromium is not installed: apt-get install chromium (.ci/run does)")
    return sync_playwright, chromium


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """JupyterLab on loopback over a folder with the solved and the wrong copy; yields (url, token)."""
    folder = tmp_path_factory.mktemp("lab")
    nb, blocks = labs.read(LAB), labs.load_blocks(labs.solutions_path(LAB))
    wrong = next(b for b in blocks if b.kind == "wrong" and b.why.startswith(WRONG))
    nbformat.write(labs.solved(nb, blocks), folder / "solved.ipynb")
    nbformat.write(labs.solved(nb, blocks, wrong=wrong), folder / "wrong.ipynb")
    settings = folder / ".settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # every cell in the page (no virtual scrolling), so each output can be found in the DOM
    # and the notebook's kernel started without the "Select Kernel" dialog
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none", "autoStartDefaultKernel": true}')
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", JUPYTERLAB_SETTINGS_DIR=str(folder / ".settings"),
               JUPYTER_CONFIG_DIR=str(folder / ".jupyter"), JUPYTER_RUNTIME_DIR=str(folder / ".runtime"))
    cmd = [sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1", f"--port={port}", "--no-browser",
           f"--notebook-dir={folder}", f"--IdentityProvider.token={token}", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"JupyterLab did not start:\n{server.stderr.read()[-3000:]}") from None
                time.sleep(0.5)
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def run_all(page, url: str, token: str, name: str) -> None:
    """Open ``name`` in JupyterLab, wait for its kernel, then Run > Run All Cells."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{url}/lab/tree/{name}?token={token}")
    page.locator(".jp-Notebook").first.wait_for(timeout=120_000)
    select = page.locator(".jp-Dialog").get_by_role("button", name="Select", exact=True)
    try:                                                # a JupyterLab that still asks for the kernel
        select.wait_for(timeout=10_000)
        select.click()
    except PlaywrightTimeout:
        pass
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(state="attached", timeout=120_000)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def test_a_solved_lab_passes_and_a_wrong_block_shows_its_hint_in_jupyterlab(lab_server):
    sync_playwright, chromium = _browser_driver()
    url, token = lab_server
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = None
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 2000})
            run_all(page, url, token, "solved.ipynb")
            for line in PASS_LINES:                         # each check's own output, in the page
                page.get_by_text(line).first.wait_for(timeout=int(os.environ.get("LAB_BROWSER_TIMEOUT_MS", 180_000)))
            assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").filter(
                has_text="Error").count() == 0, "the solved lab shows an error in the page"
            page.get_by_text(PASS_LINES[0]).first.scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "lab-acceptance-rule-solved.png"), full_page=True)

            page = browser.new_page(viewport={"width": 1280, "height": 2000})
            run_all(page, url, token, "wrong.ipynb")
            report = page.locator(".jp-OutputArea-output").filter(has_text="stays in [0, 1]")
            report.first.wait_for(timeout=180_000)          # the hint that names the slip
            assert "min(1, p / q)" in report.first.inner_text(), "the report does not say how to fix the slip"
            assert page.get_by_text("accept_probability: 5 cases pass").count() == 0, "the wrong block passed its check"
            report.first.scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "lab-acceptance-rule-wrong.png"), full_page=True)
        except Exception:
            if page is not None:                            # what the page showed when it failed
                page.screenshot(path=str(SHOTS / "lab-acceptance-rule-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
