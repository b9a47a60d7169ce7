"""Start Megatron-Core's ``torch_dist`` checkpoint writer helper before a process is ready.

A ``torch_dist`` save (``--ckpt-format torch_dist``, Megatron-LM's default) hands each rank's
write results to a ``multiprocessing`` Manager process, which
``megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue``
starts on the first save, with the ``spawn`` method: a fresh interpreter that imports the
training script's modules, 1-3 s on a loaded CPU host. A rank cannot be aborted there (it is
no collective), so when a peer died during the first save the survivors noticed the death
only after that start: kill -> redone 3.1-5.6 s against 0.5-0.6 s with ``--ckpt-format
torch``, measured with kills in the save of iteration 3 (issue 44). Started here, in the
recovery's ``prepare`` step (before the process says it is ready, off every survivor's
clock), the Manager is reused by every later save of the process, as Megatron-Core caches it.
"""

from __future__ import annotations

import os
import time
from typing import Any


def start_checkpoint_writer(args: Any) -> bool:
    """Start the ``torch_dist`` write-results Manager now, where a run saves in that format.

    Returns whether it was started. Best effort: any failure leaves the start to the first
    save, as without this call, with one line.
    """
    if not getattr(args, "save", None) or getattr(args, "ckpt_format", None) != "torch_dist":
        return False
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:  # another megatron-core layout: its first save starts what it needs
        return False
    start = getattr(filesystem_async, "_get_write_results_queue", None)
    if start is None:
        return False
    t0 = time.perf_counter()
    try:
        start()
    except Exception as err:  # noqa: BLE001  (the first save starts it then)
        print(f"> MeCeFO recovery: the checkpoint writer was not started early: {err}", flush=True)
        return False
    if os.environ.get("RANK", "0") == "0" or int(os.environ.get("MECEFO_RECOVERY_INC", "0")) > 0:
        print(
            f"> MeCeFO recovery: rank {os.environ.get('RANK', '?')}: torch_dist checkpoint "
            f"writer started before ready in {time.perf_counter() - t0:.2f} s",
            flush=True,
        )
    return True
