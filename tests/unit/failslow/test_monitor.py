"""The trainer glue: the forward-backward timing up to the gradient sync, the piggybacked
exchange (each rank's slots summed as the loss all-reduce sums them) and the decision every
rank reads from it. A fake clock stands for the wall time; the all-reduce is the sum of the
ranks' tensors, which is what gloo's SUM computes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_mecefo.failslow import FailSlowConfig, compute_clock
from megatron_mecefo.failslow.monitor import FailSlowMonitor, build_monitor


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _rank(replica: int, clock: Clock, cfg: FailSlowConfig, tp: int = 1):
    mon = FailSlowMonitor(cfg, replica, 2, tp, 4, controller=None, print_line=lambda _l: None)
    config = SimpleNamespace(finalize_model_grads_func=lambda *a, **k: None)

    def forward_backward(compute_s: float, sync_s: float, **kw):
        clock.now += compute_s  # the micro-batches
        config.finalize_model_grads_func()  # the sync starts: the wait is not compute
        clock.now += sync_s
        return []

    return mon, mon.wrap(forward_backward, config)


def test_exchange_measures_compute_only_and_every_rank_decides_alike(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(compute_clock.time, "perf_counter", clock)
    cfg = FailSlowConfig(mode="detect", window=3)
    # TP2: two ranks per replica, each adds half of its time into its replica's slot.
    ranks = [_rank(0, clock, cfg, tp=2), _rank(0, clock, cfg, tp=2)]
    ranks += [_rank(1, clock, cfg, tp=2), _rank(1, clock, cfg, tp=2)]
    fields = []
    for it in range(1, 6):
        slow = it >= 2
        parts = []
        for mon, fb in ranks:
            # Replica 1 computes 2x as long from iteration 2; replica 0 then waits in the sync.
            compute = 0.4 if (mon.replica == 1 and slow) else 0.2
            fb(compute, 0.6 - compute)
            parts.append(mon.piggyback(torch.tensor([3.0, 8.0], dtype=torch.float64)))
        total = sum(parts[1:], parts[0])  # the loss all-reduce (SUM)
        outs = [mon.observe(total.clone(), it) for mon, _ in ranks]
        assert all(torch.equal(o, torch.tensor([12.0, 32.0], dtype=torch.float64)) for o in outs)
        step = [mon.step_fields(0.6) for mon, _ in ranks]
        assert all(s == step[0] for s in step)  # the same record and lines on every rank
        fields.append(step[0])
    first = fields[0][0]["fail_slow"]
    assert first["time_per_microbatch_s"] == [0.05, 0.05]  # 0.2 s / 4 micro-batches
    last, lines = fields[-1][0]["fail_slow"], [ln for f in fields for ln in f[1]]
    assert last["slow"] == [1] and last["ratio"] == [1.0, 2.0]
    assert len(lines) == 1 and "replica 1 is slow: 2.00x" in lines[0]
    assert "detect only" in lines[0]


def test_off_and_single_replica_build_nothing() -> None:
    assert build_monitor(FailSlowConfig(mode="off"), 0, 2, 2, 4, None, False, print) is None
    assert build_monitor(FailSlowConfig(), 0, 1, 1, 4, None, False, print) is None
    assert build_monitor(FailSlowConfig(), 0, 4, 1, 4, None, True, print) is None
    mon = build_monitor(FailSlowConfig(), 1, 2, 4, 4, None, False, print)  # TP x PP = 4
    assert mon is not None and mon.ranks_per_replica == 4
