"""Recovery at model scale: about 1.1 GiB of state per rank (the example trainer, 6 layers
of hidden 1024, fp32 with Adam: 76 M parameters; at 660 MiB a new world's own native overhead,
about 70 MiB, came within 1% of the 1.05 bound under load), DP3 under the supervisor.
Rank 1 is SIGKILLed in its forward pass and replaced a second later: the survivors regroup
without it, then the replacement rejoins and is healed from one survivor while the third only
waits.

The heal is made slower than ``--collective-timeout`` on purpose (a delay before each of its
4 MiB messages): it must still complete, with no generation formed by a timeout.

Memory is sampled from outside (VmRSS, every 50 ms) with the iteration the job had logged.
"""

from __future__ import annotations

import json
from typing import Any, Dict

import pytest
from harness import Job, check_every_sample_once, train_records
from rss_sampler import RssSampler

COLLECTIVE_TIMEOUT_S = 10.0
HEAL_DELAY_S = 0.08
"""Per heal message (4 MiB): about 215 messages, so the heal takes about 17 s, over the
collective timeout."""

MODEL = [
    "--num-layers", "6", "--hidden-size", "1024", "--num-attention-heads", "8",
    "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "6",
    "--lr", "1e-4", "--lr-decay-style", "constant", "--split", "90,10,0",
    "--make-vocab-size-divisible-by", "256", "--eval-iters", "0", "--log-interval", "1",
    "--train-iters", "20", "--mecefo", "--mecefo-rank", "16",
]  # fmt: skip
STATE_BYTES = 16 * 75_510_784  # about: parameters x (weights, gradients, two Adam moments)
KILL_ITERATION = 10
ITERS = 20
PEAK_BOUND = 1.15
AFTER_BOUND = 1.05


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory: pytest.TempPathFactory, text_data: str) -> Dict[str, Any]:
    workdir = tmp_path_factory.mktemp("heal_at_scale")
    args = MODEL + [
        "--data-path", text_data, "--mecefo-kill", f"1:{KILL_ITERATION}:forward",
    ]  # fmt: skip
    job = Job(
        workdir, 3, args,
        supervisor_args=["--replace", "after:1", "--standby", "1",
                         "--collective-timeout", str(COLLECTIVE_TIMEOUT_S)],
        MECEFO_HEAL_BUCKET_MB="4",
        MECEFO_TEST_HEAL_DELAY_S=str(HEAL_DELAY_S),
    )  # fmt: skip
    sampler = RssSampler(job.rank_pids, job.metrics)
    try:
        job.start()
        sampler.start()
        codes = job.wait(timeout=900)
    finally:
        sampler.stop()
        job.stop()
    samples = {f"{k[0]}.{k[1]}": v for k, v in sampler.samples.items()}
    (workdir / "rss.json").write_text(json.dumps(samples))  # kept for a failure's reading
    assert codes == [0], job.log()[-5000:]
    return {"job": job, "sampler": sampler}


def _records(run: Dict[str, Any]) -> list:
    return run["job"].records_of("recovery")


def test_heal_slower_than_the_collective_timeout_forms_no_spurious_generation(
    scale_run: Dict[str, Any],
) -> None:
    failure, rejoin, *rest = _records(scale_run)
    assert not rest, rest  # one failure, one rejoin: no generation formed by a timeout
    assert failure["ranks_lost"] == [1] and rejoin["kind"] == "rejoin", (failure, rejoin)
    assert rejoin["ranks_lost"] == [] and rejoin["ranks_joined"] == [1]
    # The transfer really outlasted the collective timeout.
    assert rejoin["heal_transfer_s"] > COLLECTIVE_TIMEOUT_S, rejoin
    log = scale_run["job"].log()
    assert "healed; parameters and optimizer state identical" in log
    assert "ranks [] lost" not in log
    check_every_sample_once(train_records(scale_run["job"].metrics), ITERS, 6, 3, mbs=1)


def test_heal_moves_the_state_to_the_joiner_only(scale_run: Dict[str, Any]) -> None:
    rejoin = _records(scale_run)[1]
    roles = rejoin["heal_roles"]
    assert sorted(roles.values()) == ["bystander", "joiner", "sender"], roles
    written = {roles[s]: n for s, n in rejoin["heal_written_bytes"].items()}
    # Weights and both Adam moments (no gradients): about 3/4 of the state, once.
    assert 0.6 * STATE_BYTES < rejoin["heal_bytes"] < 0.9 * STATE_BYTES, rejoin
    assert written["sender"] >= rejoin["heal_bytes"], written
    # The member that holds the state and is not the source sends nothing but store polls.
    assert written["bystander"] < 1 << 20, written


def test_the_joiner_heals_into_the_heap_it_faulted_in_while_waiting(
    scale_run: Dict[str, Any],
) -> None:
    """The replacement faulted in a heap block of its slot's published state size while it
    waited for the rejoin's boundary (state/warm_heap.py): its model and the state it
    received took those pages, so the receive itself made few pages resident (one per 4 KiB
    of the heal's bytes without it)."""
    rejoin = _records(scale_run)[1]
    assert rejoin["heal_warm_bytes"] >= rejoin["heal_bytes"], rejoin
    assert rejoin["heal_page_faults"] <= 0.05 * rejoin["heal_bytes"] / 4096, rejoin


def _steady(sampler: RssSampler, key: tuple, killed_at: float) -> float:
    """A survivor's steady state: the high-water mark of its steps before the kill
    (iterations 2-9; Adam's moments exist from the first step). A step's own peak is part of
    what a rank must hold, so peaks are compared with a peak. The window is that long because
    glibc's heap is still growing into its plateau over the first steps (``mallinfo2``: the
    heap 1,002 -> 1,101 MiB over iterations 1-5 in one run, with the same bytes in use; a
    survivor's high-water mark 1,709 MiB over iterations 2-5 and 1,739 over 2-8 in another)."""
    return float(max(sampler.window(key, 2, KILL_ITERATION - 1, before=killed_at)))


def _memory_report(scale_run: Dict[str, Any]) -> Dict[Any, Any]:
    """Per survivor: steady (MiB) and the regroup, heal and after peaks over it; the joiner's
    peak over its own steady state."""
    sampler: RssSampler = scale_run["sampler"]
    healed_at = _records(scale_run)[1]["iteration"]  # the first iteration of the full world
    killed_at = sampler.last_seen[(1, 0)]  # the victim's last sample
    report: Dict[Any, Any] = {}
    for slot in (0, 2):  # the survivors: regroup, then sender or bystander of the heal
        key = (slot, 0)
        steady = _steady(sampler, key, killed_at)
        # From the kill until the rejoin's boundary: release, rebuild, import, degraded steps.
        regroup = sampler.window(key, 0, healed_at - 2, after=killed_at)
        # The switch at the boundary (logged iteration healed_at - 1) and the heal.
        heal = sampler.window(key, healed_at - 1, healed_at)
        # "Within two iterations": the processes' own slow growth (history, allocator) over a
        # long run is not the recovery's.
        after = sampler.window(key, healed_at + 2, healed_at + 3)
        report[slot] = {
            "steady_MiB": round(steady / 2**20),
            "regroup": round(max(regroup) / steady, 3),
            "heal": round(max(heal) / steady, 3),
            "after": round(max(after) / steady, 3),
        }
    joiner = max(sampler.window((1, 1), healed_at + 2, ITERS - 1))
    joiner_peak = max(sampler.window((1, 1), 0, healed_at + 1))  # its start and heal
    report["joiner"] = {"steady_MiB": round(joiner / 2**20), "peak": round(joiner_peak / joiner, 3)}
    print(f"RSS against steady: {report}")
    return report


def test_regroup_holds_no_second_copy_of_the_state(scale_run: Dict[str, Any]) -> None:
    """From the kill to the rejoin (release, rebuild without initialisation, the carry
    imported tensor by tensor, degraded steps): peak RSS within 1.15x steady. Before, the
    fresh model sat beside the carry and an interrupted backward kept the old gradients."""
    report = _memory_report(scale_run)
    assert all(report[slot]["regroup"] <= PEAK_BOUND for slot in (0, 2)), report


def test_heal_memory_within_bounds(scale_run: Dict[str, Any]) -> None:
    """Sender, bystander and joiner peak within 1.15x through the heal."""
    report = _memory_report(scale_run)
    for slot in (0, 2):
        assert report[slot]["heal"] <= PEAK_BOUND, report
    assert report["joiner"]["peak"] <= PEAK_BOUND, report


def test_survivors_back_within_1_05x_two_iterations_after_the_heal(
    scale_run: Dict[str, Any],
) -> None:
    """The survivors are back within 1.05x of steady two iterations after the heal. It was
    met only at the margin (1.027 to 1.057 in runs of one commit) while the generation loop
    kept the failed step's exception, through a loop variable, and with it the old world's
    frames until the next failure; after that fix, 0.98 to 1.07 over 20 runs (3 over the
    bound), the rest being the heap's layout: a survivor's discarded new parameters left holes
    among its live tensors, which later steps' temporaries spread over. Built mapped on their
    own (``state.memory.mapped_allocations``), 0.99 to 1.052 over 25 runs (one over); with the
    steady state taken over iterations 2-9 instead of 2-5 (:func:`_steady`), 0.98 to 1.035
    over 9. The heap's layout moves both figures by a few percent from run to run."""
    report = _memory_report(scale_run)
    for slot in (0, 2):
        assert report[slot]["after"] <= AFTER_BOUND, report
