"""SIGINT / SIGTERM for the supervisor: the first is noted for its loop (which stops the ranks,
letting them save when they can: ``Supervisor._begin_stop``), a second kills at once."""

from __future__ import annotations

import os
import signal
from typing import Any, Optional

from megatron_mecefo.recovery.processes import kill


class Signals:
    """SIGINT / SIGTERM: the first asks the supervisor's loop to stop every rank and standby
    (it notes the signal; the loop acts within half a heartbeat interval); a second one kills
    them at once and exits. Neither raises inside the loop (a KeyboardInterrupt used to end in
    a traceback, a second one in a C++ ``terminate called`` abort at interpreter exit)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.supervisor: Optional[Any] = None
        """The running ``Supervisor`` (not imported here: the supervisor imports this module)."""

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    @staticmethod
    def code(signum: int) -> int:
        """The exit status of a process stopped by ``signum`` (130 for SIGINT, 143 SIGTERM)."""
        return 128 + signum

    def _handle(self, signum: int, _frame: object) -> None:
        sup = self.supervisor
        running = sup is not None and (sup.children or sup.standby)
        if self.signum is None and running:
            self.signum = signum  # the loop stops the ranks (and lets them save, if they can)
            return
        name = signal.Signals(signum).name
        ended = 0
        if sup is not None:
            for child in [*sup.children.values(), *sup.standby]:
                kill(child.proc.pid)
                ended += 1
        what = "second " if self.signum is not None else ""
        line = f"stopped by a {what}{name}"
        line += f": {ended} rank and standby processes killed now" if ended else ""
        print(f"[supervisor node {sup.node if sup else 0}] {line}", flush=True)
        os._exit(self.code(self.signum or signum))


SIGNALS = Signals()
"""The supervisor process's one handler (installed by ``python -m ...supervisor``)."""
