"""The website as a reader sees it: every page of the TOC opened in headless Chromium.

The built site (``_build/html``, rebuilt here first when it is missing or older than its sources)
is served on 127.0.0.1 and every page is opened in one browser, read in light mode, then switched
to dark mode with the theme's own button and read again. Each page must load only from
127.0.0.1, log no console error, fit the window, show every image and every stored figure (a
shrunk one enlarging on a click, on white in dark mode; none shrunk below 70% at 1280 pixels, where
every code cell must also fit its column), have every formula typeset by the
vendored MathJax, link only to pages and anchors that exist, and offer its source for download; a
chapter must open Colab on itself and state its prerequisites and what it adds to the package;
the landing page's diagram must link every published chapter. For a person to look at, it saves a
full-page screenshot of every page under ``_build/screenshots/``, and in ``dark/`` one screen of
it in dark mode, around its first figure; ``WEBSITE_SCREENSHOTS=0`` skips them (CI does: nobody
looks at them there, and they are half of this file's time).

Chromium is the system's (``apt-get install chromium``; another binary via ``CHROMIUM_PATH``),
driven by Playwright. Without one these tests skip, except when ``REQUIRE_BROWSER=1`` (CI sets it):
then they fail.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from book import ROOT, colab_url, toc_files

HTML = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or "/usr/bin/chromium"
# Playwright adds --headless, a fresh --user-data-dir, --no-first-run, --disable-sync,
# --disable-background-networking and --disable-component-update by itself.
# Every host but 127.0.0.1 fails to resolve at once: a page that reaches out never waits on the
# network, and its request is still recorded (and fails the test).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
VIEWPORT = {"width": 1280, "height": 900}
PHONE = {"width": 400, "height": 800}
LOAD_AHEAD = 3  # pages loading in the background while one is read: keeps both CPU cores busy
PAGE_TIMEOUT_MS = 120_000  # generous: the machine may be shared
SCREENSHOTS_WANTED = os.environ.get("WEBSITE_SCREENSHOTS", "1") != "0"
PAGES = toc_files()
CHAPTERS = [p for p in PAGES if (ROOT / f"{p}.ipynb").exists()]
FIGURE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
HIDDEN_OUTPUT_TAGS = {"remove-output", "remove_output", "remove-cell", "remove_cell"}
CDN_HOSTS = (
    "unpkg.com",
    "cdn.jsdelivr.net",
    "cdnjs.cloudflare.com",
    "fonts.googleapis.com",
    "fonts.gstatic.com",
    "cdn.mathjax.org",
    "polyfill.io",
    "code.jquery.com",
)
MYST_MATHJAX_CLASSES = "tex2jax_process|mathjax_process|math|output_area"


def _ids(page: str) -> str:
    return page.replace("/", "-")


# ---------------------------------------------------------------------------------------------
# The site: built when stale, served on 127.0.0.1
# ---------------------------------------------------------------------------------------------


def _sources() -> list[Path]:
    files = [ROOT / "_config.yml", ROOT / "_toc.yml", ROOT / "references.bib"]
    files += [ROOT / f"{p}{suffix}" for p in PAGES for suffix in (".md", ".ipynb")]
    for folder in ("_static", "_vendor"):
        files += [f for f in (ROOT / folder).rglob("*") if f.is_file()]
    return [f for f in files if f.exists()]


def _site_is_stale() -> bool:
    stamp = HTML / ".buildinfo"
    if not stamp.exists() or not all((HTML / f"{p}.html").exists() for p in PAGES):
        return True
    return max(f.stat().st_mtime for f in _sources()) > stamp.stat().st_mtime


def _build_site() -> None:
    # --all: an incremental build with no page changed does not copy a changed _static/ file.
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    done = subprocess.run(
        [str(jupyter_book), "build", str(ROOT), "--all", "-W", "-n", "--keep-going"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(
            f"jupyter-book build failed:\n{(done.stdout + done.stderr)[-4000:]}", pytrace=False
        )


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    if _site_is_stale():
        _build_site()
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(HTML))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()
    thread.join()


# ---------------------------------------------------------------------------------------------
# The browser: one for the module; each page visited once per mode, results cached
# ---------------------------------------------------------------------------------------------


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the python package playwright is missing (pip install -r requirements.txt)"
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM_PATH)"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"REQUIRE_BROWSER=1 but {missing}", pytrace=False)
        pytest.skip(f"no browser check: {missing}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        yield chromium
        chromium.close()


@dataclass
class Visit:
    """What one page showed and did in the browser, in light mode and then in dark mode."""

    requests: list[str] = field(default_factory=list)
    bad_responses: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    light: dict = field(default_factory=dict)
    dark: dict = field(default_factory=dict)
    enlarged: bool | None = (
        None  # the first shrunk figure opened at full size on a click, and closed
    )
    phone_overflow: int = 0  # how much wider than a phone's window the page is


# Run in the page once it has loaded: wait for images, MathJax and fonts, then read the DOM.
INSPECT_JS = r"""
async () => {
  for (const img of document.images) img.loading = "eager";
  await Promise.all(Array.from(document.images, (img) => img.decode().catch(() => null)));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await document.fonts.ready;
  const abs = (el) => new URL(el.getAttribute("href"), document.baseURI).href;
  const article = document.querySelector("article.bd-article");
  const prose = article.cloneNode(true);
  prose.querySelectorAll("pre, code, script, style, mjx-container, .cell_output, svg").forEach((el) => el.remove());
  const rgb = (el, prop) => getComputedStyle(el)[prop];
  return {
    theme: document.documentElement.dataset.theme,
    overflow: document.documentElement.scrollWidth - window.innerWidth,
    images: Array.from(document.images, (img) => ({
      src: img.getAttribute("src"), loaded: img.complete && img.naturalWidth > 0,
      output: img.closest("div.cell_output") !== null, zoomable: img.classList.contains("book-zoomable"),
      shrunk: img.naturalWidth > 1.15 * img.clientWidth,
      scale: img.naturalWidth ? img.clientWidth / img.naturalWidth : 1,
      background: getComputedStyle(img).backgroundColor, filter: getComputedStyle(img).filter,
    })),
    math: Array.from(document.querySelectorAll("article .math"), (el) => ({
      tex: el.textContent.slice(0, 80), typeset: el.querySelector("mjx-container") !== null,
    })),
    mathContainers: document.querySelectorAll("mjx-container").length,
    // Code cells whose source or printed output is wider than the column: the reader would
    // scroll sideways and miss the ends of the lines.
    wideCode: Array.from(document.querySelectorAll(
        "div.cell div.cell_input pre, div.cell div.cell_output pre"))
      .filter((pre) => pre.scrollWidth > pre.clientWidth + 1)
      .map((pre) => pre.textContent.split("\n").reduce((a, b) => (b.length > a.length ? b : a), "")),
    // TeX that MathJax could not read: an error node, or an undefined macro (shown as red text).
    mathErrors: window.MathJax && MathJax.startup && MathJax.startup.document
      ? Array.from(MathJax.startup.document.math).filter((item) => {
          let bad = false;
          item.root.walkTree((node) => {
            bad ||= node.isKind("merror") || (node.isKind("mtext") && node.attributes.get("mathcolor") === "red");
          });
          return bad;
        }).map((item) => item.math)
      : [],
    mathjax: window.MathJax && MathJax.version ? {
      version: MathJax.version, processHtmlClass: String(MathJax.config.options.processHtmlClass),
    } : null,
    prose: prose.textContent,
    links: Array.from(document.querySelectorAll("a[href]"), abs),
    tableLinks: Array.from(document.querySelectorAll("article.bd-article table a[href]"), abs),
    colab: Array.from(document.querySelectorAll("a[href*='colab.research.google.com']"), (a) => ({
      href: a.href, badge: a.querySelector("img[src*='colab-badge']") !== null,
      launch: a.closest(".dropdown-launch-buttons") !== null,
    })),
    downloads: Array.from(document.querySelectorAll("a.btn-download-source-button"), abs),
    diagram: Array.from(document.querySelectorAll("svg.arch a[data-chapter]"), (a) => ({
      chapter: a.dataset.chapter, href: a.getAttribute("href"),
      box: a.querySelector(".arch-box, .arch-frame") ? rgb(a.querySelector(".arch-box, .arch-frame"), "fill") : null,
      text: a.querySelector("text") ? rgb(a.querySelector("text"), "fill") : null,
    })),
  };
}
"""


def _switch_theme(page, theme: str) -> None:
    """Click the header's light/dark switch (it cycles through its modes) until ``theme`` shows."""
    for _ in range(3):
        if page.evaluate("document.documentElement.dataset.theme") == theme:
            return
        page.dispatch_event(
            "button.theme-switch-button", "click"
        )  # a click without hover: no tooltip
    assert page.evaluate("document.documentElement.dataset.theme") == theme, (
        f"the theme switch never gave {theme}"
    )


def _start(browser, url: str) -> tuple[Visit, object]:
    """Open ``url`` in a fresh context (its own storage: the page starts in the default mode) and
    return as soon as the navigation has started, so that pages load side by side."""
    visit = Visit()
    context = browser.new_context(viewport=VIEWPORT, color_scheme="light")
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    page = context.new_page()
    page.on("request", lambda request: visit.requests.append(request.url))
    page.on(
        "response",
        lambda response: (
            response.status >= 400
            and visit.bad_responses.append(f"{response.status} {response.url}")
        ),
    )
    page.on("requestfailed", lambda request: visit.bad_responses.append(f"failed {request.url}"))
    page.on(
        "console",
        lambda message: (
            message.type == "error"
            and visit.console_errors.append(f"{message.text} ({message.location.get('url', '')})")
        ),
    )
    page.on("pageerror", lambda error: visit.console_errors.append(f"uncaught: {error}"))
    page.goto(url, wait_until="commit")
    return visit, page


def _finish(visit: Visit, page, name: str) -> Visit:
    """Read the loaded page in light mode, switch it to dark with the theme's button, read it again."""
    page.wait_for_load_state("load")
    _switch_theme(page, "light")
    visit.light = page.evaluate(INSPECT_JS)
    if SCREENSHOTS_WANTED:
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    zoomable = page.query_selector("div.cell_output img.book-zoomable")
    if zoomable:
        zoomable.click()
        opened = page.evaluate("() => document.querySelector('.book-zoom img')?.naturalWidth > 0")
        page.keyboard.press("Escape")
        visit.enlarged = opened and page.query_selector(".book-zoom") is None
    _switch_theme(page, "dark")
    visit.dark = page.evaluate(INSPECT_JS)
    # Dark mode, one screen: around the first figure (or the diagram), else the top of the page.
    if SCREENSHOTS_WANTED:
        page.evaluate("""() => { const f = document.querySelector("div.cell_output img, svg.arch");
                                 window.scrollTo(0, f ? f.getBoundingClientRect().top + scrollY - 200 : 0); }""")
        page.screenshot(path=str(SCREENSHOTS / "dark" / f"{name}.png"))
    page.set_viewport_size(PHONE)
    visit.phone_overflow = page.evaluate(
        "document.documentElement.scrollWidth - window.innerWidth"
    )
    page.context.close()
    return visit


@pytest.fixture(scope="module")
def visits(request, browser, base_url) -> dict[str, Visit]:
    """Every page the selected tests need (all of the TOC in a full run), visited once: up to
    LOAD_AHEAD more pages load while one is read."""
    (SCREENSHOTS / "dark").mkdir(parents=True, exist_ok=True)
    wanted = {
        item.callspec.params.get("page", PAGES[0]) if hasattr(item, "callspec") else PAGES[0]
        for item in request.session.items
        if item.module is request.module
    }
    pages = [page for page in PAGES if page in wanted]
    started, done = {}, {}
    for i, page in enumerate(pages):
        for ahead in pages[i : i + LOAD_AHEAD + 1]:
            if ahead not in started and ahead not in done:
                started[ahead] = _start(browser, f"{base_url}{ahead}.html")
        done[page] = _finish(*started.pop(page), Path(page).name)
    return done


# ---------------------------------------------------------------------------------------------
# Checks, one per property and page
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_page_loads_only_from_this_site_without_errors(visits, base_url, page):
    visit = visits[page]
    elsewhere = [u for u in visit.requests if not u.startswith((base_url, "data:", "blob:"))]
    assert not elsewhere, f"requests to another host (the site must work offline): {elsewhere}"
    assert not visit.bad_responses, f"resources that failed to load: {visit.bad_responses}"
    assert not visit.console_errors, f"console errors: {visit.console_errors}"


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_page_fits_the_window(visits, page):
    overflow = visits[page].light["overflow"]
    assert overflow <= 0, f"the page is {overflow}px wider than a {VIEWPORT['width']}px window"
    overflow = visits[page].phone_overflow
    assert overflow <= 0, (
        f"the page is {overflow}px wider than a phone's {PHONE['width']}px window"
    )


def _stored_figures(page: str) -> int:
    nb = nbformat.read(ROOT / f"{page}.ipynb", as_version=4)
    return sum(
        any(kind in output.get("data", {}) for kind in FIGURE_TYPES)
        for cell in nb.cells
        if cell.cell_type == "code" and not HIDDEN_OUTPUT_TAGS & set(cell.metadata.get("tags", []))
        for output in cell.outputs
    )


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_image_and_stored_figure_shows(visits, page):
    images = visits[page].light["images"]
    broken = [img["src"] for img in images if not img["loaded"]]
    assert not broken, f"images that did not load: {broken}"
    if page in CHAPTERS:
        stored, shown = _stored_figures(page), sum(img["output"] for img in images)
        assert shown >= stored, f"the notebook stores {stored} figures, the page shows {shown}"


@pytest.mark.parametrize("page", CHAPTERS, ids=_ids)
def test_shrunk_figures_enlarge_on_click(visits, page):
    visit = visits[page]
    figures = [img for img in visit.light["images"] if img["output"]]
    stuck = [img["src"] for img in figures if img["shrunk"] and not img["zoomable"]]
    assert not stuck, f"figures shown shrunk that a click does not enlarge: {stuck}"
    if any(img["zoomable"] for img in figures):
        assert visit.enlarged, (
            "clicking a shrunk figure did not show it at full size (or Escape did not close it)"
        )


# A figure drawn at most 9.5 inches wide (dpi 110) shows at 70% or more in the 752-pixel column of
# a 1280-pixel window, so its 11-point tick labels stay at 11 pixels or more.
MIN_FIGURE_SCALE = 0.7


@pytest.mark.parametrize("page", CHAPTERS, ids=_ids)
def test_figures_are_not_shrunk_out_of_legibility(visits, page):
    figures = [img for img in visits[page].light["images"] if img["output"]]
    small = [
        f"{img['src']} at {img['scale']:.0%}" for img in figures if img["scale"] < MIN_FIGURE_SCALE
    ]
    assert not small, (
        f"figures shown below {MIN_FIGURE_SCALE:.0%} of their size in a {VIEWPORT['width']}px window "
        f"(draw them at most 9.5 inches wide): {small}"
    )


@pytest.mark.parametrize("page", CHAPTERS, ids=_ids)
def test_code_cells_and_their_outputs_fit_the_column(visits, page):
    wide = visits[page].light["wideCode"]
    assert not wide, (
        f"code or printed output wider than the column in a {VIEWPORT['width']}px window (keep "
        f"lines to 99 characters; scripts/check_outputs.py finds printed ones): {wide}"
    )


RAW_TEX = re.compile(r"\$\$|\\[()\[\]]|(?<![\w$])\$[^\s$][^$\n]*\$|\\[a-zA-Z]{2,}")


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_formula_is_typeset(visits, page):
    dom = visits[page].light
    untypeset = [m["tex"] for m in dom["math"] if not m["typeset"]]
    assert not untypeset, f"formulas MathJax did not typeset: {untypeset}"
    assert dom["mathContainers"] >= len(dom["math"])
    assert not dom["mathErrors"], f"TeX errors: {dom['mathErrors']}"
    leftover = RAW_TEX.findall(dom["prose"])
    assert not leftover, f"raw TeX in the text (a formula that never became math): {leftover}"
    if dom["math"]:
        assert dom["mathjax"] and dom["mathjax"]["version"].startswith("3."), (
            "MathJax 3 did not load"
        )
        assert dom["mathjax"]["processHtmlClass"] == MYST_MATHJAX_CLASSES, (
            "MyST's mathjax3_config was lost"
        )


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    return frozenset(re.findall(r'\bid="([^"]+)"', path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_internal_links_resolve(visits, base_url, page):
    broken = []
    for link in sorted(set(visits[page].light["links"])):
        if not link.startswith(base_url):
            continue  # another site (GitHub, Colab, a paper): not reachable from here
        parts = urlsplit(link)
        target = HTML / unquote(parts.path.lstrip("/"))
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            broken.append(f"{link} (no such file)")
        elif (
            parts.fragment
            and target.suffix == ".html"
            and unquote(parts.fragment) not in _anchors(target)
        ):
            broken.append(f"{link} (no such anchor)")
    assert not broken, f"links to nothing: {broken}"


@pytest.mark.parametrize("page", CHAPTERS, ids=_ids)
def test_chapter_opens_in_colab_on_itself(visits, page):
    expected = colab_url(ROOT / f"{page}.ipynb")
    colab = visits[page].light["colab"]
    assert any(a["badge"] for a in colab), "no Open in Colab badge on the page"
    assert any(a["launch"] for a in colab), "no Colab launch button in the header"
    wrong = {a["href"] for a in colab} - {expected}
    assert not wrong, f"Colab links should all be {expected}, found {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_download_button_gives_the_source(visits, base_url, page):
    downloads = visits[page].light["downloads"]
    assert downloads, "no download button"
    suffix = ".ipynb" if page in CHAPTERS else ".md"
    assert downloads == [f"{base_url}_sources/{page}{suffix}"]
    served = HTML / "_sources" / f"{page}{suffix}"
    if suffix == ".ipynb":
        assert nbformat.reads(served.read_text(encoding="utf-8"), as_version=4).cells, (
            "the downloaded notebook is empty"
        )


@pytest.mark.parametrize("page", CHAPTERS, ids=_ids)
def test_chapter_states_prerequisites_and_what_it_adds(visits, page):
    text = visits[page].light["prose"]
    for words in ("Prerequisites", "Adds to the package"):
        assert words in text, f"the chapter's introduction should say **{words}:**"


def _channel(value: str) -> list[float]:
    return [int(c) / 255 for c in re.findall(r"\d+", value)[:3]]


def _contrast(a: str, b: str) -> float:
    def luminance(color: str) -> float:
        lin = [
            c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in _channel(color)
        ]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_dark_mode_keeps_figures_legible(visits, page):
    dom = visits[page].dark
    assert dom["theme"] == "dark"
    for img in dom["images"]:
        if img["output"]:
            assert img["background"] == "rgb(255, 255, 255)", (
                f"{img['src']}: figure not on white in dark mode"
            )
            assert img["filter"] == "none", (
                f"{img['src']}: figure colours altered in dark mode ({img['filter']})"
            )
    for box in dom["diagram"]:
        if box["text"] and box["box"]:
            assert _contrast(box["text"], box["box"]) >= 4.5, (
                f"diagram box {box['chapter']}: text unreadable in dark mode"
            )


def test_landing_page_links_every_published_chapter(visits, base_url):
    dom = visits[PAGES[0]].light
    boxes = dom["diagram"]
    assert boxes, "the landing page lost its architecture diagram"
    for box in boxes:
        published = box["chapter"] in CHAPTERS
        assert (box["href"] is not None) == published, (
            f"diagram box {box['chapter']}: {'published, so it must link' if published else 'not in _toc.yml, so no link'}"
        )
        assert _contrast(box["text"], box["box"]) >= 4.5, (
            f"diagram box {box['chapter']}: text unreadable"
        )
    in_diagram = {box["chapter"] for box in boxes}
    links = set(dom["tableLinks"])
    for chapter in CHAPTERS:
        assert chapter in in_diagram, f"{chapter} has no box in intro.md's diagram"
        assert f"{base_url}{chapter}.html" in links, (
            f"intro.md's table should link {chapter}: write its row as [N. Title]({chapter}.ipynb)"
        )


def test_sidebar_buttons_open_the_navigation(browser, base_url):
    """The article header's buttons collapse the sidebar on a wide screen and open the navigation
    and the page's contents as drawers on a phone (book.js passes their clicks on to the theme)."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.goto(f"{base_url}{(CHAPTERS or PAGES)[0]}.html", wait_until="load")
    collapsed = (
        "document.querySelector('#pst-primary-sidebar').classList.contains('pst-sidebar-hidden')"
    )
    page.click(".bd-header-article .primary-toggle")
    assert page.evaluate(collapsed), "the sidebar button does not collapse the sidebar"
    page.click(".bd-header-article .primary-toggle")
    assert not page.evaluate(collapsed), "the sidebar button does not bring the sidebar back"
    page.set_viewport_size(PHONE)
    for side in ("primary", "secondary"):
        page.click(f".bd-header-article .{side}-toggle")
        assert page.evaluate(f"document.querySelector('#pst-{side}-sidebar-modal').open"), (
            f"the {side} sidebar does not open on a phone"
        )
        page.keyboard.press("Escape")
    context.close()


def test_built_pages_name_no_cdn():
    if _site_is_stale():
        _build_site()
    found = {}
    for page in [HTML / f"{p}.html" for p in PAGES] + [
        HTML / "search.html",
        HTML / "genindex.html",
    ]:
        text = page.read_text(encoding="utf-8")
        hits = sorted({host for host in CDN_HOSTS if host in text})
        hits += re.findall(
            r"<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=\"(https?://[^\"]+)\"", text
        )
        if hits:
            found[page.relative_to(HTML).as_posix()] = hits
    assert not found, f"pages that would load from another host: {json.dumps(found, indent=1)}"
