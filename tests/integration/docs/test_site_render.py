"""The built docs site in headless Chromium (issue 45, item 8): the home, Megatron-LM and
results pages render, and no code block on the Megatron-LM page is cut off at 1280 px.

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
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest
from conftest import REPO

SITE = Path(os.environ.get("MECEFO_SITE_DIR", REPO / "site"))
PAGES = {"home": "", "megatron-lm": "megatron-lm/", "results": "results/"}
WIDTH, HEIGHT = 1280, 900

# Every <pre> block (Material puts a fenced block's <code> inside it and scrolls the <pre>
# or the <code>, depending on the version): how much of it is hidden to the right.
MEASURE = """JSON.stringify({
  title: document.title,
  elements: document.getElementsByTagName('*').length,
  text: document.body.innerText.length,
  width: document.documentElement.clientWidth,
  blocks: Array.from(document.querySelectorAll('article pre')).map((pre, i) => {
    const code = pre.querySelector('code') || pre;
    const first = (code.textContent.split('\\n')[0] || '').slice(0, 70);
    return {i: i, first: first,
            pre: [pre.scrollWidth, pre.clientWidth], code: [code.scrollWidth, code.clientWidth]};
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


@pytest.fixture(scope="module")
def rendered() -> Iterator[Dict[str, Dict[str, Any]]]:
    """Each page of PAGES loaded at 1280 px: its measurements (and its screenshot)."""
    binary = _browser()
    if binary is None:
        _skip_or_fail("no Chromium on PATH (make test-docs installs Debian's chromium)")
    if not (SITE / "index.html").is_file():
        _skip_or_fail(f"no built site at {SITE} (make docs builds it)")
    shots = os.environ.get("MECEFO_SCREENSHOT_DIR")
    with tempfile.TemporaryDirectory(prefix="mecefo-chromium-") as profile:
        # The browser first: preexec_fn runs in the forked child, safe only without threads.
        browser = DevTools(binary, profile)
        handler = functools.partial(Quiet, directory=str(SITE))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            out: Dict[str, Dict[str, Any]] = {}
            for name, path in PAGES.items():
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
            yield out
        finally:
            browser.close()
            server.shutdown()


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_with_its_title(rendered: Dict[str, Dict[str, Any]], page: str) -> None:
    """Each page has the site's title and a real body (not an error page or an empty shell)."""
    got = rendered[page]
    assert got["width"] == WIDTH, got["width"]
    assert "megatron-mecefo" in got["title"], got["title"]
    assert got["elements"] > 200 and got["text"] > 2000, (page, got["elements"], got["text"])


def test_no_code_block_on_the_megatron_lm_page_is_cut_off(
    rendered: Dict[str, Dict[str, Any]],
) -> None:
    """At 1280 px every code block on the Megatron-LM page shows its longest line whole."""
    blocks = rendered["megatron-lm"]["blocks"]
    assert len(blocks) >= 4, blocks
    cut = [b for b in blocks if b["pre"][0] > b["pre"][1] + 1 or b["code"][0] > b["code"][1] + 1]
    assert not cut, "code blocks wider than the page at 1280 px: " + json.dumps(cut, indent=1)
