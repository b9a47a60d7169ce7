"""Every member's wait for the joiners' done keys (``recovery/state/heal.py:
wait_for_heals``), on a real ``TCPStore``: woken by the store, a deadline on progress only,
and a reason to stop honoured."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Iterator, List, Optional

import pytest
from torch.distributed import TCPStore

from megatron_mecefo.recovery.state.heal import mark_done, wait_for_heals

POLL_S = 0.01


@pytest.fixture
def store() -> Iterator[TCPStore]:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))  # fmt: skip
    yield server
    del server


def _later(delay_s: float, fn) -> threading.Thread:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn()), daemon=True)
    t.start()
    return t


def test_woken_by_the_store_not_by_polling(store: TCPStore) -> None:
    """The wait returns once both joiners are done, and looks at the abort reason about
    every 5 x poll_s, not every poll_s (the bystanders' store round trips during a heal)."""
    client = TCPStore("127.0.0.1", store.port, is_master=False,
                      timeout=datetime.timedelta(seconds=30))  # fmt: skip
    looks: List[float] = []

    def abort_check() -> Optional[str]:
        looks.append(time.monotonic())
        return None

    last_marked: List[float] = []

    def mark_last() -> None:
        # Stamped before the key is set: a wait that returned before the second joiner was
        # done returns before this stamp, whatever the load on the machine.
        last_marked.append(time.monotonic())
        mark_done(client, "heal/3", 2)

    setter = _later(0.2, lambda: mark_done(client, "heal/3", 1))
    last = _later(0.4, mark_last)
    waited = wait_for_heals(store, "heal/3", [1, 2], [0], stall_s=30.0, poll_s=POLL_S,
                            abort_check=abort_check)  # fmt: skip
    returned = time.monotonic()
    setter.join()
    last.join()
    assert last_marked and returned >= last_marked[0]
    # Polling every poll_s would have looked about 40 times; the store wakes it instead.
    assert len(looks) <= waited / (5 * POLL_S) + 2, (len(looks), waited)


def test_a_stall_stops_the_wait_and_progress_keeps_it(store: TCPStore) -> None:
    """No source's count moving for stall_s fails the wait; a count that moves does not,
    however long the heal."""
    with pytest.raises(RuntimeError, match="no progress for"):
        wait_for_heals(store, "heal/4", [1], [0], stall_s=0.3, poll_s=POLL_S,
                       abort_check=lambda: None)  # fmt: skip

    def report() -> None:
        for n in range(1, 9):
            store.set("heal/5/sent/0", str(n))
            time.sleep(0.1)
        mark_done(store, "heal/5", 1)

    threading.Thread(target=report, daemon=True).start()
    waited = wait_for_heals(store, "heal/5", [1], [0], stall_s=0.35, poll_s=POLL_S,
                            abort_check=lambda: None)  # fmt: skip
    assert waited > 0.35  # longer than the stall deadline, and never stalled


def test_a_reason_to_stop_ends_the_wait(store: TCPStore) -> None:
    with pytest.raises(RuntimeError, match="heal stopped: generation 7 was announced"):
        wait_for_heals(store, "heal/6", [1], [0], stall_s=30.0, poll_s=POLL_S,
                       abort_check=lambda: "generation 7 was announced")  # fmt: skip
