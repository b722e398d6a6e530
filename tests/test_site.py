"""The built site in a real browser: pages render, math typesets with no network, links resolve.

The book is built with the README's command (`make book`'s jupyter-book call, warnings as errors),
served from _build/html on 127.0.0.1, and loaded in headless Chromium. A screenshot of each page
checked lands in _build/screenshots/.
"""
import functools
import json
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
SCREENSHOTS = {"intro.html", "book/00-start/how-kernels-run.html"}


def chapter_pages() -> dict[str, tuple[str, bool]]:
    """``{page: (title, has math)}`` for the intro and every book notebook."""
    pages = {"intro.html": ("The Path to LLM Mastery", False)}
    for nb_path in sorted((ROOT / "book").rglob("*.ipynb")):
        cells = json.loads(nb_path.read_text())["cells"]
        markdown = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        title = next(line[2:].strip() for line in markdown.splitlines() if line.startswith("# "))
        page = nb_path.relative_to(ROOT).with_suffix(".html").as_posix()
        pages[page] = (title, "$" in markdown)
    return pages


PAGES = chapter_pages()
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--virtual-time-budget=20000", "--window-size=1280,2400",
]

pytestmark = pytest.mark.slow


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    message = ("Debian's chromium is not installed, so the site was not checked in a browser: "
               "install it with `apt-get install chromium` (.ci/run does)")
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def site():
    book = [str(Path(sys.executable).parent / "jupyter-book"), "build", "--warningiserror", "--keep-going",
            "--path-output", str(ROOT), str(ROOT)]
    proc = subprocess.run(book, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f"the book did not build:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    handler = functools.partial(QuietHandler, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def render(url: str, page: str, tmp_path: Path) -> str:
    """The DOM of ``page`` after its scripts ran (and a screenshot of the pages in SCREENSHOTS)."""
    browser = chromium()
    profile = tmp_path / "profile"
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / (page.replace("/", "_").removesuffix(".html") + ".png")
    common = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    dom = subprocess.run([*common, "--dump-dom", f"{url}/{page}"], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    if page in SCREENSHOTS:
        subprocess.run([*common, f"--screenshot={shot}", f"{url}/{page}"], capture_output=True, timeout=120)
        assert shot.is_file() and shot.stat().st_size > 10_000, "chromium wrote no screenshot"
    return dom.stdout


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_with_typeset_math_and_no_network(site, page, tmp_path):
    dom = render(site, page, tmp_path)
    title, has_math = PAGES[page]
    # Sphinx's smartquotes render an apostrophe as a right single quote: "Blackwell's" -> "Blackwell’s".
    rendered_title = html.escape(title, quote=False).replace("'", "\u2019")
    assert rendered_title in dom, f"{page}: title {title!r} not in the rendered page"
    if has_math:  # Sphinx loads MathJax only on pages that have math
        assert "<mjx-container" in dom, f"{page}: MathJax produced no typeset math"
        assert 'src="../../_static/mathjax/' in dom, f"{page}: MathJax is not served from the site itself"
        assert "<mjx-merror" not in dom, f"{page}: MathJax could not typeset some math"
    scripts = re.findall(r'<script[^>]+src="([^"]+)"', dom)
    remote = [s for s in scripts if urlparse(s).netloc and not s.startswith(site)]
    assert not remote, f"{page} loads scripts from the network: {remote}"
    if page.startswith("book/"):
        assert dom.count('class="cell_input') >= 5, "code cells missing"
        assert dom.count('class="cell_output') >= 5, "outputs missing"
        assert "download-source-button" in dom, "no download-notebook button"


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.targets.append(value)


def broken_links(html_root: Path) -> list[str]:
    broken = []
    for page in html_root.rglob("*.html"):
        if "_static" in page.relative_to(html_root).parts:  # theme templates, not pages
            continue
        parser = Links()
        parser.feed(page.read_text(errors="replace"))
        for target in parser.targets:
            parsed = urlparse(target)
            if parsed.scheme or parsed.netloc or target.startswith(("#", "mailto:", "data:", "javascript:")):
                continue
            path = unquote(parsed.path)
            if not path:
                continue
            resolved = (page.parent / path).resolve()
            if resolved.is_dir():
                resolved = resolved / "index.html"
            if not resolved.exists():
                broken.append(f"{page.relative_to(html_root)} -> {target}")
    return broken


def test_no_broken_internal_links(site):
    assert not broken_links(HTML)


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html">b</a><a href="missing.html#x">m</a><img src="https://x.org/y.png">')
    (tmp_path / "b.html").write_text("<p>b</p>")
    assert broken_links(tmp_path) == ["a.html -> missing.html#x"]
