"""The documentation site builds in strict mode, offline, and every page renders in a real headless browser.

The site (mkdocs.yml, docs/) is built into a temporary directory with `mkdocs build --strict`, served by a real HTTP
server on loopback, and opened in Debian's headless chromium through its chromedriver (selenium). Starting from the
home page the test follows the navigation to every page (and must reach every page the build wrote), and on each:

- the page rendered: a title and an h1, and not the site's 404 page;
- every <a href> into the site resolves (HTTP 200), and a link's #fragment names an element of its target page;
- every <img> loaded (naturalWidth > 0);
- everything the page loaded (scripts, styles, fonts, images) came from the site itself: no network at view time
  (the browser also resolves no other host name).

A strict build with a broken link must fail (mkdocs.yml's own settings, inherited). chromium and chromium-driver
are Debian packages: .ci/run installs them when they are missing, and so does this test where it can (as root or
with sudo), skipping with one line only when they cannot be installed.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)
BUILD_ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=600,
        env=BUILD_ENV,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    started = time.perf_counter()
    res = _build(ROOT / "mkdocs.yml", out)
    print(f"mkdocs build --strict: {time.perf_counter() - started:.1f} s")
    assert res.returncode == 0, res.stderr[-4000:]
    assert (out / "index.html").is_file()
    return out


def test_a_broken_link_fails_the_strict_build(tmp_path: Path):
    """mkdocs.yml's settings (strict, link and anchor validation) over a one-page site with a broken link."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [a page that does not exist](missing.md) and [here](#nowhere).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {docs}\nnav:\n  - index.md\nhooks: []\nplugins:\n  - search\n"
    )
    res = _build(config, tmp_path / "site")
    assert res.returncode != 0, res.stderr
    assert "missing.md" in res.stderr and "nowhere" in res.stderr, res.stderr


# ------------------------------------------------------------------------------------------------ the browser
def _install_chromium() -> str | None:
    """Install Debian's chromium and chromium-driver if they are missing; None when ready, else why not."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return None
    if not shutil.which("apt-get"):
        return "no apt-get to install chromium and chromium-driver"
    if os.geteuid() == 0:
        prefix = []
    elif shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        prefix = ["sudo", "-n"]
    else:
        return "not root and no password-less sudo to install chromium and chromium-driver"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        res = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=900, env=env)
        if res.returncode != 0:
            return f"`{' '.join(argv)}` failed: {res.stderr.strip().splitlines()[-1:]}"
    return None if shutil.which("chromium") and shutil.which("chromedriver") else "chromium still missing"


@pytest.fixture(scope="module")
def server(site: Path):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def browser():
    why = _install_chromium()
    if why:
        pytest.skip(f"the documentation site's browser test needs Debian's chromium and chromium-driver: {why}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must not look for a driver on the network
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    # no host name resolves but loopback's: a page that reached for the network would fail to load it
    options.add_argument("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost")
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


_PAGE_STATE = """
const abs = (u) => { try { return new URL(u, document.baseURI).href } catch (e) { return u } };
return {
  title: document.title,
  h1: Array.from(document.querySelectorAll("article h1, .md-content h1")).map(h => h.textContent.trim()),
  nav: Array.from(document.querySelectorAll("nav.md-nav a.md-nav__link[href]")).map(a => a.href),
  links: Array.from(document.querySelectorAll("a[href]")).map(a => a.href),
  images: Array.from(document.images).map(i => [i.currentSrc || i.src, i.complete, i.naturalWidth]),
  resources: performance.getEntriesByType("resource").map(r => r.name)
    .concat(Array.from(document.querySelectorAll("script[src]")).map(s => abs(s.src)))
    .concat(Array.from(document.querySelectorAll("link[href]")).map(l => abs(l.href))),
};
"""


def _status(url: str, cache: dict[str, tuple[int, str]]) -> tuple[int, str]:
    if url not in cache:
        try:
            with urllib.request.urlopen(url, timeout=30) as res:
                cache[url] = (res.status, res.read().decode("utf-8", "replace"))
        except urllib.error.HTTPError as e:
            cache[url] = (e.code, "")
    return cache[url]


def test_every_page_renders_in_a_headless_browser(site: Path, server: str, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    started = time.perf_counter()
    fetched: dict[str, tuple[int, str]] = {}
    queue, seen, problems = deque([server + "index.html"]), set(), []
    while queue:
        page = queue.popleft()
        if page in seen:
            continue
        seen.add(page)
        browser.get(page)
        WebDriverWait(browser, 30).until(
            lambda d: d.execute_script("return document.readyState === 'complete' && "
                                       "Array.from(document.images).every(i => i.complete)")
        )  # fmt: skip
        state = browser.execute_script(_PAGE_STATE)
        where = page.removeprefix(server)
        if not state["title"].strip() or not state["h1"] or not state["h1"][0]:
            problems.append(f"{where}: no title or h1 ({state['title']!r}, {state['h1']})")
        if any("404" in h for h in state["h1"]) or state["title"].startswith("404"):
            problems.append(f"{where}: the 404 page")
        for nav in state["nav"]:
            target = urldefrag(nav)[0]
            if target.startswith(server) and target.endswith(".html"):
                queue.append(target)
        for link in state["links"]:
            target, fragment = urldefrag(link)
            if not target.startswith(server):
                continue  # a link out of the site (the theme's credit) is not followed: nothing is loaded from it
            code, html = _status(target, fetched)
            if code != 200:
                problems.append(f"{where}: link {link} -> HTTP {code}")
            elif fragment and target.endswith(".html") and not re.search(rf'id="{re.escape(fragment)}"', html):
                problems.append(f"{where}: link {link}: no element #{fragment} on its page")
        for src, complete, width in state["images"]:
            if not complete or width <= 0:
                problems.append(f"{where}: image {src} did not load (naturalWidth {width})")
        for resource in state["resources"]:
            if urlparse(resource).scheme not in ("data", "blob") and not resource.startswith(server):
                problems.append(f"{where}: loads {resource} from outside the site")
    built = {server + p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html"}
    unreached = sorted(p.removeprefix(server) for p in built - seen)
    took = time.perf_counter() - started
    print(f"{len(seen)} pages, {len(fetched)} distinct link targets checked in {took:.1f} s")
    assert not problems, "\n".join(problems[:50])
    assert not unreached, f"pages the navigation does not reach: {unreached}"
    assert len(seen) >= 20, sorted(seen)
