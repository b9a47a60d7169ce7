"""A call on a daemon thread, as a future: a call that never returns (a vote on a hung store,
in a failed test) must not hold up the test process's exit, as a pool's worker would."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a new daemon thread; its result or exception in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 (handed to the test)
            future.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    return future
