"""One process of the snapshot tests (single rank, gloo world of 1, real TCPStore).

``python snapshot_worker.py MODE DIR OUT``:

* ``write-and-die``: trains a ~100 MB model (torch Adam) one step, snapshots iteration 1 and
  waits for its commit, writes its CRC to OUT, steps again, starts the snapshot of iteration
  2 and SIGKILLs itself while that copy runs;
* ``restore``: restores the newest intact snapshot from DIR into a fresh model and writes
  the restored iteration and CRC to OUT.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from megatron_mecefo.snapshot.checksum import crc32
from megatron_mecefo.snapshot.config import SnapshotConfig
from megatron_mecefo.snapshot.contents import TrainingState
from megatron_mecefo.snapshot.manager import SnapshotManager


class Wrapped:
    """The shape of a Megatron optimizer that ``contents`` reads: ``.optimizer`` inside."""

    def __init__(self, params) -> None:
        self.optimizer = torch.optim.Adam(params, lr=1e-3)


def build() -> tuple[torch.nn.Module, Wrapped]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))
    return model, Wrapped(model.parameters())


def step(model: torch.nn.Module, opt: Wrapped) -> None:
    loss = model(torch.ones(4, 2048)).square().mean()
    loss.backward()
    opt.optimizer.step()
    opt.optimizer.zero_grad()


def digest(state: TrainingState) -> int:
    """CRC of every parameter and Adam moment, in a fixed order."""
    value = 0
    for p in state.model_chunks[0].parameters():
        value = crc32(p.detach().contiguous()) ^ (value * 31 & 0xFFFFFFFF)
        for key in ("exp_avg", "exp_avg_sq"):
            t = state.optimizer.optimizer.state[p][key]
            value = crc32(t.contiguous()) ^ (value * 31 & 0xFFFFFFFF)
    return value


def main() -> None:
    mode, directory, out = sys.argv[1:4]
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model, opt = build()
    config = SnapshotConfig(interval=1, directory=directory)
    manager = SnapshotManager(config, rank=0, world_size=1, store=store)
    if mode == "write-and-die":
        step(model, opt)
        state = TrainingState([model], opt, None, {"iteration": 1, "consumed_samples": 8})
        manager.take(state, 1)
        manager.flush()
        with open(out, "w") as f:
            json.dump({"crc": digest(state)}, f)
        manager.before_optimizer_step()
        step(model, opt)
        manager.take(TrainingState([model], opt, None, {"iteration": 2}), 2)
        os.kill(os.getpid(), signal.SIGKILL)  # the copy thread has just started
    else:
        state = TrainingState([model], opt, None, {})
        served = manager.restore(state)
        with open(out, "w") as f:
            json.dump({"served": served, "crc": digest(state), "counters": state.counters}, f)


if __name__ == "__main__":
    main()
