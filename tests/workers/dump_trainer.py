"""The example trainer, plus a dump of every rank's final parameters (tests only).

Run as ``python tests/workers/dump_trainer.py <trainer flags>`` under torchrun or the
supervisor; with ``MECEFO_TEST_DUMP=DIR`` each rank that finishes writes
``DIR/slot<original rank>.pt``: its parameters by name, its original (tp, dp, pp), iteration.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "pretrain_gpt"))

import pretrain_gpt  # noqa: E402

_finish = pretrain_gpt.Trainer.finish


def finish(self, wall_s: float) -> None:
    import torch
    from megatron.core import parallel_state as ps

    out = os.environ.get("MECEFO_TEST_DUMP")
    if out:
        slot = int(os.environ.get("MECEFO_RECOVERY_SLOT", os.environ.get("RANK", "0")))
        params = {
            f"{i}.{name}": p.detach().clone()
            for i, chunk in enumerate(self.model_chunks)
            for name, p in chunk.named_parameters()
        }
        torch.save(
            {
                "params": params,
                "tp": ps.get_tensor_model_parallel_rank(),
                "pp": ps.get_pipeline_model_parallel_rank(),
                "replica": self.dp_rank,
                "iteration": self.iteration,
                # A promoted standby's must be its slot's (the device it binds).
                "local_rank": int(os.environ["LOCAL_RANK"]),
                "pid": os.getpid(),
            },
            Path(out) / f"slot{slot}.pt",
        )
    _finish(self, wall_s)


pretrain_gpt.Trainer.finish = finish

_train_step = pretrain_gpt.Trainer.train_step


def train_step(self):
    """``MECEFO_TEST_STEP_SLEEP`` seconds more per iteration: leaves a joiner time to start."""
    import time

    time.sleep(float(os.environ.get("MECEFO_TEST_STEP_SLEEP", "0")))
    return _train_step(self)


pretrain_gpt.Trainer.train_step = train_step


def _digest_log() -> None:
    """``MECEFO_TEST_DIGESTS=DIR``: before each parity exchange, every rank appends
    ``iteration sha256`` of its slot's optimizer tensors to ``DIR/slot<slot>.txt``: the shard
    it holds, to compare with the one the survivors rebuild after its death."""
    out = os.environ.get("MECEFO_TEST_DIGESTS")
    if not out:
        return
    from megatron_mecefo.snapshot import manager
    from megatron_mecefo.snapshot.parity import optimizer_digest

    exchange = manager.SnapshotManager._exchange_parity

    def logged(self, slot, header, group):
        digest = optimizer_digest(header, slot.buffer[: header["nbytes"]].numpy())
        with open(Path(out) / f"slot{self.slot_id}.txt", "a") as f:
            f.write(f"{header['iteration']} {digest}\n")
        return exchange(self, slot, header, group)

    manager.SnapshotManager._exchange_parity = logged


_digest_log()

if __name__ == "__main__":
    pretrain_gpt.main()
