"""The built docs site in headless Chromium: every page of the nav renders, and no table or
code block on any page is wider than its column at 1280 px (nothing hidden behind a scroll bar).

`make test-docs` builds the site into ``site/`` and runs this file with Chromium installed
(``MECEFO_SITE_DIR`` names another build, ``MECEFO_REQUIRE_BROWSER=1`` turns the skips into
failures). Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
no port, no network), and the site is served from a local ``http.server`` thread. Each page's
screenshot is written to ``MECEFO_SCREENSHOT_DIR`` when it is set.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
from conftest import REPO

SITE = Path(os.environ.get("MECEFO_SITE_DIR", REPO / "site"))
WIDTH, HEIGHT = 1280, 900


def _nav_pages() -> Dict[str, str]:
    """Every page of mkdocs.yml's nav (``name.md`` -> its URL path with directory URLs)."""
    nav = (REPO / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    pages = {}
    for md in re.findall(r":\s*([\w/-]+)\.md\s*$", nav, flags=re.M):
        pages[md] = "" if md == "index" else f"{md}/"
    return pages


PAGES = _nav_pages()

# The content column (Material's .md-content: a table's wrapper reaches into the article's
# padding by design), the page, every table and every <pre> block (Material puts a fenced block's
# <code> inside it and scrolls the <pre> or the <code>, depending on the version; a table
# scrolls itself or its wrapper): each as [scrollWidth, clientWidth], so a width hidden to the
# right shows as the first above the second.
MEASURE = """JSON.stringify({
  title: document.title,
  elements: document.getElementsByTagName('*').length,
  text: document.body.innerText.length,
  width: document.documentElement.clientWidth,
  column: (() => { const c = document.querySelector('.md-content');
                   return c ? [c.scrollWidth, c.clientWidth] : [0, 0]; })(),
  page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
  blocks: Array.from(document.querySelectorAll('article pre')).map((pre, i) => {
    const code = pre.querySelector('code') || pre;
    const first = (code.textContent.split('\\n')[0] || '').slice(0, 70);
    return {i: i, first: first,
            pre: [pre.scrollWidth, pre.clientWidth], code: [code.scrollWidth, code.clientWidth]};
  }),
  tables: Array.from(document.querySelectorAll('article table')).map((table, i) => {
    const wrap = table.closest('.md-typeset__scrollwrap') || table.parentElement;
    const head = (table.querySelector('tr') || table).innerText.replace(/\\s+/g, ' ');
    return {i: i, first: head.slice(0, 70),
            table: [table.scrollWidth, table.clientWidth],
            wrap: [wrap.scrollWidth, wrap.clientWidth]};
  }),
})"""


def _browser() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("MECEFO_REQUIRE_BROWSER") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def _pipe_fds(read_end: int, write_end: int) -> None:
    """In the child: put the two pipe ends on fds 3 and 4 (via fds above 10, so neither
    dup2 overwrites the other end)."""
    high_read = fcntl.fcntl(read_end, fcntl.F_DUPFD, 10)
    high_write = fcntl.fcntl(write_end, fcntl.F_DUPFD, 10)
    os.dup2(high_read, 3)
    os.dup2(high_write, 4)


class DevTools:
    """A minimal DevTools-protocol client over Chromium's pipe (fd 3 in, fd 4 out)."""

    def __init__(self, binary: str, profile: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # The child sees our read end of the first pipe as fd 3 and the write end of the
        # second as fd 4, which is what --remote-debugging-pipe expects.
        self.proc = subprocess.Popen(
            [
                binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox",
                "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--hide-scrollbars", f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}",
                "about:blank",
            ],  # fmt: skip
            pass_fds=(3, 4),
            preexec_fn=functools.partial(_pipe_fds, to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next = 0
        self.events: list[Dict[str, Any]] = []

    def _read_message(self, deadline: float) -> Dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError(f"Chromium closed its pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, session: Optional[str] = None, **params: Any) -> Dict[str, Any]:
        """Send one command and return its result (events seen meanwhile are kept)."""
        self._next += 1
        command: Dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session:
            command["sessionId"] = session
        os.write(self._to_chrome, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + 60
        while True:
            message = self._read_message(deadline)
            if message.get("id") == self._next:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_event(self, method: str, session: str, timeout: float = 60) -> None:
        """Wait until ``method`` has been seen for ``session``."""
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method and event.get("sessionId") == session:
                    del self.events[i]
                    return
            self.events.append(self._read_message(deadline))

    def close(self) -> None:
        """End the browser by its PID (and close our pipe ends)."""
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


class Quiet(http.server.SimpleHTTPRequestHandler):
    """The site's files, without a log line per request."""

    def log_message(self, *args: Any) -> None:  # noqa: D102
        pass


def render(pages: Dict[str, str], shots: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """Load each page (name -> URL path under the site) at 1280 px in headless Chromium and
    return its measurements; write its screenshot to ``shots`` when given."""
    binary = _browser()
    assert binary is not None
    with tempfile.TemporaryDirectory(prefix="mecefo-chromium-") as profile:
        # The browser first: preexec_fn runs in the forked child, safe only without threads.
        browser = DevTools(binary, profile)
        handler = functools.partial(Quiet, directory=str(SITE))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            out: Dict[str, Dict[str, Any]] = {}
            for name, path in pages.items():
                target = browser.call("Target.createTarget", url="about:blank")["targetId"]
                session = browser.call("Target.attachToTarget", targetId=target, flatten=True)[
                    "sessionId"
                ]
                browser.call("Page.enable", session)
                browser.call(
                    "Emulation.setDeviceMetricsOverride",
                    session,
                    width=WIDTH,
                    height=HEIGHT,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                url = f"http://127.0.0.1:{server.server_port}/{path}"
                browser.call("Page.navigate", session, url=url)
                browser.wait_event("Page.loadEventFired", session)
                value = browser.call(
                    "Runtime.evaluate", session, expression=MEASURE, returnByValue=True
                )["result"]["value"]
                out[name] = json.loads(value)
                if shots:
                    png = browser.call("Page.captureScreenshot", session, format="png")["data"]
                    Path(shots).mkdir(parents=True, exist_ok=True)
                    (Path(shots) / f"{name}.png").write_bytes(base64.b64decode(png))
                browser.call("Target.closeTarget", targetId=target)
            return out
        finally:
            browser.close()
            server.shutdown()


@pytest.fixture(scope="module")
def rendered() -> Dict[str, Dict[str, Any]]:
    """Every page of the nav loaded at 1280 px: its measurements (and its screenshot)."""
    if _browser() is None:
        _skip_or_fail("no Chromium on PATH (make test-docs installs Debian's chromium)")
    if not (SITE / "index.html").is_file():
        _skip_or_fail(f"no built site at {SITE} (make docs builds it)")
    return render(PAGES, os.environ.get("MECEFO_SCREENSHOT_DIR"))


def _cut(pairs: list, keys: tuple) -> list:
    """The measured elements whose content is wider than their box (1 px of rounding allowed)."""
    return [m for m in pairs if any(m[k][0] > m[k][1] + 1 for k in keys)]


def test_every_nav_page_is_rendered() -> None:
    """The nav names every page of docs/ that the site builds (so none escapes this test)."""
    assert len(PAGES) >= 25, PAGES
    built = {p.stem for p in (REPO / "docs").glob("*.md")}
    assert built <= set(PAGES), sorted(built - set(PAGES))


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_with_its_title(rendered: Dict[str, Dict[str, Any]], page: str) -> None:
    """Each page has the site's title and a real body (not an error page or an empty shell)."""
    got = rendered[page]
    assert got["width"] == WIDTH, got["width"]
    assert "megatron-mecefo" in got["title"], got["title"]
    assert got["elements"] > 150 and got["text"] > 500, (page, got["elements"], got["text"])


@pytest.mark.parametrize("page", list(PAGES))
def test_nothing_on_the_page_is_cut_off(rendered: Dict[str, Dict[str, Any]], page: str) -> None:
    """At 1280 px the content column, every table and every code block show their widest
    line whole: nothing is hidden behind a horizontal scroll bar."""
    got = rendered[page]
    for part in ("column", "page"):
        width = got[part]
        assert width[1] > 0 and width[0] <= width[1] + 1, (page, part, width)
    cut_blocks = _cut(got["blocks"], ("pre", "code"))
    cut_tables = _cut(got["tables"], ("table", "wrap"))
    assert (
        not cut_blocks and not cut_tables
    ), f"{page}: wider than the column at 1280 px: " + json.dumps(
        {"code blocks": cut_blocks, "tables": cut_tables}, indent=1
    )


def test_the_measure_sees_code_blocks_and_tables(rendered: Dict[str, Dict[str, Any]]) -> None:
    """The measurement finds what it checks (a selector that matched nothing would pass)."""
    assert len(rendered["megatron-lm"]["blocks"]) >= 4, rendered["megatron-lm"]["blocks"]
    assert len(rendered["results"]["tables"]) >= 4, rendered["results"]["tables"]
