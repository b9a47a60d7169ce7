"""A world's data-loader workers end when the rank leaves it (``stop_loader_workers``).

Left to the garbage collector inside a reference cycle (a failure's traceback holds the
iterator), torch's shutdown message never reaches a worker: the queues' finalizers end their
feeder threads before the iterator's ``__del__`` runs, which then waits out a 5 s join timeout
per worker (measured: 5.1 s for one loader here, 15.3 s per rejoin with Megatron-LM's three).
"""

from __future__ import annotations

import gc

from torch.utils.data import DataLoader

from megatron_mecefo.megatron_lm.recovery import stop_loader_workers


def test_workers_exit_on_their_message_and_the_collector_has_nothing_left() -> None:
    loaders = [DataLoader(range(64), batch_size=2, num_workers=1, persistent_workers=True)
               for _ in range(2)]  # fmt: skip
    for loader in loaders:
        next(iter(loader))
    workers = [w for loader in loaders for w in loader._iterator._workers]
    single = DataLoader(range(8), batch_size=2)  # --num-workers 0: nothing to stop
    next(iter(single))
    stop_loader_workers([*loaders, single])
    # Ended by the time it returns (None: still running).
    assert [w.exitcode for w in workers] == [0, 0]
    # Collected in a cycle afterwards, as a failure leaves it: the shutdown already ran.
    cycle: list = [loaders]
    cycle.append(cycle)
    iterators = [loader._iterator for loader in loaders]
    assert all(it._shutdown for it in iterators)
    del loaders, cycle, iterators
    gc.collect()
