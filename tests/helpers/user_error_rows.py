"""The user-mistake table of docs/errors.md: one ``Row`` per mistake (issue 34), with the
commands, the signal actions and the checks its rows name. The rows run in
``tests/integration/examples/test_user_errors.py``;
``tests/unit/examples/test_user_errors_table.py`` checks the table itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from conftest import REPO, TRAINER

TP = "pretrain_gpt.py: error:"
SUP = "megatron_mecefo.recovery.supervisor: error:"
STOPPED = "[supervisor node 0] stopped by"
EXITING = "> exiting at iteration"

SMALL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--eval-iters", "0", "--log-interval", "1",
]  # fmt: skip
MOCK = ["--mock-data", *SMALL]
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "0.5", "--collective-timeout",
        "1", "--init-timeout", "2"]  # fmt: skip
PY = sys.executable
SUPERVISOR = [PY, "-m", "megatron_mecefo.recovery.supervisor"]


@dataclass
class Row:
    """One mistake: the command (``{name}`` placeholders filled from the row's fixtures),
    the exit code, the start of its one line and the words that line must hold."""

    id: str
    kind: str  # flags | data | files | resume | launch | signals
    cmd: list[str]
    code: int
    prefix: str
    words: list[str]
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # fixtures: data, ckpt, busy_port
    action: Optional[Callable[[subprocess.Popen, Path], None]] = None
    check: Optional[Callable[[str, Path], None]] = None
    slow: bool = False
    timeout: float = 120
    startup_s: float = 30
    """A start-up row's bound: it fails before a model is built (Megatron-LM's rows import
    megatron.training first: 4-7 s alone, 38-43 s once at a load average of 15-31)."""


def trainer(*flags: str) -> list[str]:
    """The trainer as plain ``python`` (a row's env sets WORLD_SIZE/RANK as torchrun would)."""
    return [PY, str(TRAINER), *flags]


def rank_env(world: int = 2, **extra: str) -> dict[str, str]:
    return {"WORLD_SIZE": str(world), "RANK": "0", **extra}


def supervised(*trainer_flags: str, sup: tuple[str, ...] = ()) -> list[str]:
    return [*SUPERVISOR, "--nproc-per-node", "2", *FAST, *sup, "--", str(TRAINER),
            *trainer_flags]  # fmt: skip


def megatron_lm(*flags: str, mock: bool = True) -> list[str]:
    """Megatron-LM's pretrain_gpt.py on CPU (the ``mlm`` fixture's tree), a tiny run on mock
    data (``mock=False``: the flags give the data)."""
    from megatron_mecefo.runtime.megatron_lm_cpu import CPU_FLAGS

    return [PY, str(REPO / "patches" / "run_megatron_lm_cpu.py"), "--megatron-lm-dir",
            "{mlm}", *CPU_FLAGS, "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
            "64", "--micro-batch-size", "2", "--global-batch-size", "16",
            *(["--mock-data"] if mock else []), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--train-iters", "2", "--lr", "1e-3", *flags]  # fmt: skip


def torchrun(*cmd: str) -> list[str]:
    """``cmd`` (a python command line without the interpreter) on two ranks under torchrun."""
    return [PY, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_port={free_port}", *cmd]  # fmt: skip


# ---------------------------------------------------------------- actions of the signal rows
def _when_training(proc: subprocess.Popen, tmp: Path, iterations: int = 2) -> None:
    metrics = tmp / "m.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= iterations):
        assert proc.poll() is None, "ended before training"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)


def _signal(*signals: int) -> Callable[[subprocess.Popen, Path], None]:
    def act(proc: subprocess.Popen, tmp: Path) -> None:
        _when_training(proc, tmp)
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.05)
            proc.send_signal(sig)

    return act


def _signal_when_file(name: str, sig: int) -> Callable[[subprocess.Popen, Path], None]:
    """Signal once ``tmp/name`` exists (node 0 writes its --store-file, then waits for nodes)."""

    def act(proc: subprocess.Popen, tmp: Path) -> None:
        deadline = time.monotonic() + 60
        while not (tmp / name).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no store file"
            time.sleep(0.05)
        time.sleep(0.3)  # into the wait for nodes
        proc.send_signal(sig)

    return act


def _term_then_kill_rank_1(proc: subprocess.Popen, tmp: Path) -> None:
    """SIGTERM to the supervisor (its ranks save at the next boundary), then rank 1 dies."""
    _when_training(proc, tmp)
    rows = [line.split() for line in (tmp / "pids").read_text().splitlines()]
    pids = {slot: int(pid) for slot, _inc, pid in rows}
    proc.send_signal(signal.SIGTERM)
    os.kill(pids["1"], signal.SIGKILL)


def _not_recovered(output: str, tmp: Path) -> None:
    assert "rank 1" in output and "died while stopping: SIGKILL" in output, output[-3000:]
    for recovery in ("started a replacement", "regroup", "new generation"):
        assert recovery not in output, output[-3000:]


def _saved(output: str, tmp: Path) -> None:
    tracker = tmp / "save" / "latest_checkpointed_iteration.txt"
    assert tracker.exists(), output[-3000:]
    assert (tmp / "save" / f"iter_{int(tracker.read_text()):07d}").is_dir()


def _waited_for_nodes(output: str, tmp: Path) -> None:
    assert "waiting for nodes: joined 0" in output and "missing 1" in output, output


WITHOUT_ETCD_CLIENT = (
    "import runpy, sys; sys.modules['pyetcd'] = None; "
    "runpy.run_module('megatron_mecefo.recovery.supervisor', run_name='__main__', alter_sys=True)"
)
"""The supervisor in an interpreter where ``import pyetcd`` fails, as without the etcd client."""

NO_JOB_ID = {"MECEFO_JOB_ID": "", "SLURM_JOB_ID": ""}
"""A row's env without a job id (empty counts as unset): the key prefix is the digest."""


def _no_etcd_store_flag(output: str, tmp: Path) -> None:
    """The fix names etcd's flags, not ``--store etcd://...``, which etcd mode ignores."""
    assert "--store etcd://" not in output, output[-3000:]


def _live_job_kept(output: str, tmp: Path) -> None:
    """The refused node 0 deleted nothing and led nothing: the live job's leader key (the
    ``live_job`` fixture's) and a key beside it are still there, as they were."""
    import json

    from megatron_mecefo.recovery.etcd_control import EtcdControl

    assert "elected leader" not in output, output[-3000:]
    live = json.loads((tmp / "live_job.json").read_text())
    control = EtcdControl(live["endpoints"], live["prefix"], 2.0)
    try:
        leader, _ = control.conn.get(control.leader_key)
        marker, _ = control.conn.get(control.key("kv/layout"))
    finally:
        control.close()
    assert leader is not None and leader.value.decode() == live["leader"], leader
    assert marker is not None and marker.value.decode() == "live", marker


TRAIN_LONG = [*MOCK, "--train-iters", "100000", "--metrics-file", "{tmp}/m.jsonl"]
SUPERVISED_LONG = [*SUPERVISOR, "--nproc-per-node", "2", "--standby", "1", "--",
                   str(TRAINER), *TRAIN_LONG, "--mecefo", "--mecefo-rank", "16"]  # fmt: skip

ROWS = [
    # ------------------------------------------------------------- flags: the trainer's
    Row("lr-negative", "flags", trainer(*MOCK, "--lr", "-1"), 2, TP, ["--lr=-1.0", ">= 0"],
        rank_env()),
    Row("eval-iters-negative", "flags", trainer(*MOCK, "--eval-iters", "-1"), 2, TP,
        ["--eval-iters=-1"], rank_env()),
    Row("dropout-above-one", "flags", trainer(*MOCK, "--hidden-dropout", "2"), 2, TP,
        ["--hidden-dropout=2.0", "[0, 1)"], rank_env()),
    Row("adam-beta1-above-one", "flags", trainer(*MOCK, "--adam-beta1", "1.5"), 2, TP,
        ["--adam-beta1=1.5"], rank_env()),
    Row("clip-grad-negative", "flags", trainer(*MOCK, "--clip-grad", "-1"), 2, TP,
        ["--clip-grad=-1.0"], rank_env()),
    Row("vocab-multiple-zero", "flags", trainer(*MOCK, "--make-vocab-size-divisible-by", "0"),
        2, TP, ["--make-vocab-size-divisible-by=0"], rank_env()),
    Row("min-lr-above-lr", "flags", trainer(*MOCK, "--min-lr", "0.1", "--lr", "0.01"), 2, TP,
        ["--min-lr=0.1", "--lr=0.01"], rank_env()),
    Row("exit-duration-zero", "flags", trainer(*MOCK, "--exit-duration-in-mins", "0"), 2, TP,
        ["--exit-duration-in-mins=0"], rank_env()),
    Row("both-scheduler-flags", "flags", trainer(*MOCK, "--override-opt-param-scheduler",
        "--use-checkpoint-opt-param-scheduler"), 2, TP,
        ["--override-opt-param-scheduler", "mutually exclusive"], rank_env()),
    Row("fail-after-last-iteration", "flags", trainer(*MOCK, "--train-iters", "10", "--mecefo",
        "--mecefo-rank", "16", "--mecefo-fail", "1:200:300"), 2, TP,
        ["replica 1 fails at iteration 200", "--train-iters=10", "never fires"], rank_env()),
    Row("fail-replica-beyond-dp", "flags", trainer(*MOCK, "--mecefo", "--mecefo-rank", "16",
        "--mecefo-fail", "5:2:4"), 2, TP, ["replica 5", "2 data-parallel replicas"], rank_env()),
    Row("kill-replica-already-down", "flags", trainer(*MOCK, "--train-iters", "10", "--mecefo",
        "--mecefo-rank", "16", "--pipeline-model-parallel-size", "2", "--mecefo-fail", "1:3:8",
        "--mecefo-kill", "3:5:backward"), 2, TP,
        ["--mecefo-kill=3:5:backward", "replica 1", "already taken down"],
        rank_env(4, MECEFO_RECOVERY="{}")),
    Row("kill-rank-beyond-world", "flags", trainer(*MOCK, "--mecefo", "--mecefo-rank", "16",
        "--mecefo-kill", "7:2:backward"), 2, TP, ["rank 7 does not exist", "world size 2"],
        rank_env(2, MECEFO_RECOVERY="{}")),
    Row("kill-iteration-beyond-run", "flags", trainer(*MOCK, "--train-iters", "10", "--mecefo",
        "--mecefo-rank", "16", "--mecefo-kill", "1:50:backward"), 2, TP,
        ["iteration 50 is outside 1..10"], rank_env(2, MECEFO_RECOVERY="{}")),
    # Settings that can never act: a save-phase kill without a save at its iteration (an
    # error: a test that meant to kill in a save would pass without a death), fail-slow
    # rebalancing without a micro-batch to move and a window the run never fills (warnings:
    # the run still trains and detects).
    Row("kill-save-phase-without-save", "flags", trainer(*MOCK, "--train-iters", "20",
        "--mecefo", "--mecefo-rank", "16", "--mecefo-kill", "1:5:save-write"), 2, TP,
        ["--mecefo-kill=1:5:save-write", "no --save is given", "never fires", "add --save DIR"],
        rank_env(2, MECEFO_RECOVERY="{}")),
    Row("kill-save-phase-no-save-there", "flags", trainer(*MOCK, "--train-iters", "20",
        "--mecefo", "--mecefo-rank", "16", "--save", "{tmp}/save", "--save-interval", "10",
        "--mecefo-kill", "1:5:save-write"), 2, TP,
        ["--mecefo-kill=1:5:save-write", "no checkpoint is saved at iteration 5",
         "--save-interval=10", "never fires", "1:10:save-write"],
        rank_env(2, MECEFO_RECOVERY="{}")),
    Row("fail-slow-rebalance-one-microbatch", "flags", torchrun(str(TRAINER), *MOCK,
        "--train-iters", "2", "--mecefo", "--mecefo-rank", "16", "--mecefo-fail-slow",
        "rebalance"), 0, "WARNING: --mecefo-fail-slow=rebalance",
        ["1 micro-batch per replica", "a slow replica always keeps one micro-batch",
         "can never act", "raise --global-batch-size or lower --micro-batch-size"],
        needs=("busy_port",), slow=True, timeout=300),
    Row("fail-slow-window-beyond-run", "flags", torchrun(str(TRAINER), *MOCK, "--train-iters",
        "20", "--mecefo-fail-slow-window", "50"), 0, "WARNING: --mecefo-fail-slow-window=50",
        ["--train-iters=20", "detection can never start",
         "lower --mecefo-fail-slow-window to at most 20"],
        needs=("busy_port",), slow=True, timeout=300),
    Row("mlm-fail-slow-rebalance-one-microbatch", "flags", torchrun(*megatron_lm("--mecefo",
        "--mecefo-rank", "16", "--global-batch-size", "4", "--mecefo-fail-slow", "rebalance",
        "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0")[1:]), 0,
        "WARNING: MeCeFO: --mecefo-fail-slow=rebalance",
        ["1 micro-batch per replica", "a slow replica always keeps one micro-batch",
         "can never act", "raise --global-batch-size or lower --micro-batch-size"],
        needs=("mlm", "busy_port"), slow=True, timeout=400),
    Row("mlm-kill-save-phase-no-save-there", "flags", megatron_lm("--mecefo", "--mecefo-rank",
        "16", "--train-iters", "20", "--save", "{tmp}/save", "--save-interval", "10",
        "--mecefo-kill", "1:5:save-write"), 2, TP,
        ["--mecefo-kill=1:5:save-write", "no checkpoint is saved at iteration 5",
         "--save-interval=10", "never fires"],
        rank_env(2, MECEFO_RECOVERY="{}"), needs=("mlm",), startup_s=60),
    Row("abft-layer-beyond-model", "flags", trainer(*MOCK, "--mecefo-abft-inject",
        "kind=inf,op=scores,layer=9,iter=2"), 2, TP, ["layer 9 does not exist", "never fire"],
        rank_env()),
    Row("abft-rank-beyond-world", "flags", trainer(*MOCK, "--mecefo-abft-inject",
        "kind=inf,op=scores,layer=1,iter=2,rank=5"), 2, TP, ["rank 5 does not exist"],
        rank_env()),
    Row("abft-iteration-beyond-run", "flags", trainer(*MOCK, "--train-iters", "10",
        "--mecefo-abft-inject", "kind=inf,op=scores,layer=1,iter=500"), 2, TP,
        ["iteration 500", "--train-iters=10"], rank_env()),
    Row("abft-microbatch-beyond-batch", "flags", trainer(*MOCK, "--mecefo-abft-inject",
        "kind=inf,op=scores,layer=1,iter=2,mb=7"), 2, TP, ["micro-batch 7 does not exist"],
        rank_env()),
    Row("save-unwritable", "flags", trainer(*MOCK, "--save", "/proc/mecefo_ckpt"), 2, TP,
        ["--save /proc/mecefo_ckpt", "cannot write"], rank_env()),
    Row("metrics-file-unwritable", "flags", trainer(*MOCK, "--metrics-file", "/proc/m.jsonl"),
        2, TP, ["--metrics-file /proc/m.jsonl", "cannot write"], rank_env()),
    Row("tensorboard-dir-unwritable", "flags", trainer(*MOCK, "--tensorboard-dir", "/proc/tb"),
        2, TP, ["--tensorboard-dir /proc/tb", "cannot write"], rank_env()),
    Row("dist-opt-sgd", "flags", trainer(*MOCK, "--use-distributed-optimizer", "--optimizer",
        "sgd"), 2, TP, ["--optimizer=sgd", "Adam only"], rank_env()),
    Row("unknown-flag", "flags", trainer(*MOCK, "--num-layer", "4"), 2, TP,
        ["unrecognized arguments: --num-layer"], rank_env()),
    # ------------------------------------------------------------- flags: the supervisor's
    Row("sup-negative-replacements", "flags", supervised("--mock-data",
        sup=("--max-replacements", "-1")), 2, SUP, ["--max-replacements=-1"]),
    Row("sup-negative-standby", "flags", supervised("--mock-data", sup=("--standby", "-1")),
        2, SUP, ["--standby=-1"]),
    Row("sup-replace-rank-beyond-world", "flags", supervised("--mock-data",
        sup=("--replace", "immediately", "--replace-ranks", "5")), 2, SUP,
        ["--replace-ranks=5", "rank 5 does not exist", "world size 2"]),
    Row("sup-replace-ranks-never", "flags", supervised("--mock-data",
        sup=("--replace-ranks", "1")), 2, SUP, ["--replace-ranks=1", "--replace never"]),
    Row("sup-store-port-out-of-range", "flags", supervised("--mock-data",
        sup=("--store-port", "70000")), 2, SUP, ["--store-port=70000"]),
    Row("sup-records-unwritable", "flags", supervised("--mock-data",
        sup=("--records", "/proc/r.jsonl")), 2, SUP, ["--records /proc/r.jsonl"]),
    Row("sup-pid-file-unwritable", "flags", supervised("--mock-data",
        sup=("--pid-file", "/proc/pids")), 2, SUP, ["--pid-file /proc/pids"]),
    Row("sup-timeouts-out-of-order", "flags", supervised("--mock-data",
        sup=("--heartbeat-timeout", "5", "--collective-timeout", "2")), 2, SUP,
        ["--heartbeat-timeout=5.0", "--collective-timeout=2.0"]),
    Row("sup-zero-processes", "flags", [*SUPERVISOR, "--nproc-per-node", "0", "--",
        str(TRAINER)], 2, SUP, ["--nproc-per-node=0"]),
    Row("sup-unknown-flag", "flags", [*SUPERVISOR, "--nproc-per-node", "2", "--nodes", "2",
        "--", str(TRAINER)], 2, SUP, ["unrecognized arguments: --nodes"]),
    # ------------------------------------------------------------- data
    Row("data-other-tokenizer", "data", trainer(*SMALL, "--data-path", "{data}/foreign"), 1,
        TP, ["token id 50000", "read all of", "ByteTokenizer", "another tokenizer"],
        rank_env(), needs=("data",)),
    Row("data-empty", "data", trainer(*SMALL, "--data-path", "{data}/empty"), 1, TP,
        ["the dataset is empty"], rank_env(), needs=("data",)),
    Row("data-shorter-than-a-sample", "data", trainer(*SMALL, "--data-path", "{data}/short"),
        1, TP, ["holds 10 tokens", "--seq-length=32"], rank_env(), needs=("data",)),
    Row("data-truncated-bin", "data", trainer(*SMALL, "--data-path", "{data}/truncated"), 1,
        TP, ["truncated.bin", "truncated"], rank_env(), needs=("data",)),
    Row("data-prefix-with-extension", "data", trainer(*SMALL, "--data-path",
        "{data}/good.bin"), 2, TP, ["pass the prefix without extension"], rank_env(),
        needs=("data",)),
    Row("data-missing", "data", trainer(*SMALL, "--data-path", "{tmp}/nothing"), 2, TP,
        ["missing", "nothing.bin"], rank_env()),
    Row("data-other-tokenizer-supervised", "data", supervised(*SMALL, "--mecefo",
        "--mecefo-rank", "16", "--data-path", "{data}/foreign"), 1, SUP,
        ["start-up failure", "rank 0", "token id 50000", "nothing to resume"],
        needs=("data",)),
    # ------------------------------------------------------------- files made by something else
    Row("ckpt-other-model", "files", trainer(*MOCK, "--train-iters", "2",
        "--use-distributed-optimizer", "--hidden-size", "128", "--load", "{ckpt}"), 1, TP,
        ["checkpoint is of another model", "--hidden-size: checkpoint 64, now 128"],
        rank_env(1), needs=("ckpt",)),
    Row("ckpt-other-model-tensor-shapes", "files", trainer(*MOCK, "--train-iters", "2",
        "--use-distributed-optimizer", "--hidden-size", "128", "--load", "{ckpt_old}"), 1, TP,
        ["checkpoint of another model", "embedding.word_embeddings.weight: checkpoint [384, 64],"
         " model [384, 128]"], {}, needs=("ckpt",), slow=True),
    Row("ckpt-newer-format", "files", trainer(*MOCK, "--train-iters", "2",
        "--use-distributed-optimizer", "--load", "{ckpt_newer}"), 1, TP,
        ["format 99", "newer megatron-mecefo"], rank_env(1), needs=("ckpt",)),
    Row("ckpt-damaged-record", "files", trainer(*MOCK, "--train-iters", "2",
        "--use-distributed-optimizer", "--load", "{ckpt_garbage}"), 1, TP,
        ["mecefo_run.json cannot be read"], rank_env(1), needs=("ckpt",)),
    Row("ckpt-garbage-tracker", "files", trainer(*MOCK, "--load", "{ckpt_tracker}"), 1, TP,
        ["latest_checkpointed_iteration.txt holds", "not an iteration number"], rank_env(1),
        needs=("ckpt",)),
    Row("ckpt-other-model-supervised", "files", supervised(*MOCK, "--train-iters", "2",
        "--use-distributed-optimizer", "--mecefo", "--mecefo-rank", "16", "--hidden-size",
        "128", "--load", "{ckpt}"), 1, SUP,
        ["start-up failure", "--hidden-size: checkpoint 64, now 128"], needs=("ckpt",)),
    Row("snapshot-other-model", "files", trainer(*MOCK, "--train-iters", "3", "--hidden-size",
        "128", "--mecefo-snapshot-interval", "1", "--mecefo-snapshot-dir", "{holder}"), 1, TP,
        ["--mecefo-snapshot-dir", "taken by another model or layout",
         "model0.decoder.final_layernorm.weight: snapshot [64], model [128]"], {},
        needs=("holder",), slow=True),
    Row("planner-profile-other-version", "files", trainer(*MOCK, "--mecefo", "--mecefo-rank", "16",
        "--mecefo-policy", "auto", "--mecefo-planner-profile", "{data}/old_profile.json"), 2, TP,
        ["written by another version", "unknown key(s) written_by_v0", "planner.calibration"],
        rank_env(), needs=("data",)),
    Row("failure-trace-other-layout", "files", trainer(*MOCK, "--mecefo", "--mecefo-rank", "16",
        "--mecefo-failure-schedule", "replay", "--mecefo-failure-trace",
        "{data}/trace_dp8.json"), 2, TP, ["replica 7", "2 data-parallel replicas"], rank_env(),
        needs=("data",)),
    # ------------------------------------------------------------- resuming with changed flags
    Row("resume-longer-train-iters", "resume", trainer(*MOCK, "--train-iters", "4",
        "--use-distributed-optimizer", "--load", "{ckpt}"), 2, TP,
        ["--train-iters: checkpoint 2, now 4", "--override-opt-param-scheduler",
         "--use-checkpoint-opt-param-scheduler"], rank_env(1), needs=("ckpt",)),
    Row("resume-changed-lr", "resume", trainer(*MOCK, "--train-iters", "2", "--lr", "0.01",
        "--use-distributed-optimizer", "--load", "{ckpt}"), 2, TP,
        ["--lr: checkpoint 0.001, now 0.01"], rank_env(1), needs=("ckpt",)),
    Row("resume-per-rank-optimizer-other-tp", "resume", trainer(*MOCK, "--train-iters", "2",
        "--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--load",
        "{ckpt}"), 1, TP,
        ["--tensor-model-parallel-size: checkpoint 1, now 2", "--no-load-optim"], rank_env(2),
        needs=("ckpt",)),
    Row("ckpt-more-layers", "files", trainer(*MOCK, "--train-iters", "2",
        "--use-distributed-optimizer", "--num-layers", "4", "--load", "{ckpt}"), 1, TP,
        ["--num-layers: checkpoint 2, now 4"], rank_env(1), needs=("ckpt",)),
    Row("resume-longer-train-iters-old-checkpoint", "resume", trainer(*MOCK, "--train-iters",
        "4", "--use-distributed-optimizer", "--load", "{ckpt_old}"), 2, TP,
        ["LR schedule differs", "--override-opt-param-scheduler"], {}, needs=("ckpt",),
        slow=True),
    Row("resume-changed-global-batch-is-said", "resume", trainer(*MOCK, "--train-iters", "2",
        "--global-batch-size", "8", "--use-distributed-optimizer", "--load", "{ckpt}"), 0,
        "WARNING: resuming with a changed flag:", ["--global-batch-size: checkpoint 4, now 8"],
        {}, needs=("ckpt",), slow=True),
    # ------------------------------------------------------------- launch and rendezvous
    Row("plain-python-needs-ranks", "launch", trainer(*MOCK, "--tensor-model-parallel-size",
        "2"), 2, TP, ["world size 1", "started without a launcher", "torchrun --nproc_per_node"]),
    Row("rank-env-without-rendezvous", "launch", trainer(*MOCK), 2, TP,
        ["WORLD_SIZE=2", "MASTER_ADDR", "not started by a launcher"], rank_env()),
    Row("store-port-in-use", "launch", supervised("--mock-data",
        sup=("--store-port", "{busy_port}")), 1, SUP,
        ["--store-port {busy_port}", "127.0.0.1:{busy_port} is already in use"],
        needs=("busy_port",)),
    Row("store-unreachable", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--nnodes", "2",
        "--node-rank", "1", "--store", "127.0.0.1:{free_port}", *FAST, "--", str(TRAINER)], 1,
        SUP, ["--store 127.0.0.1:{free_port}", "did not answer within --init-timeout=2s"],
        needs=("busy_port",)),
    Row("store-host-unknown", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--nnodes", "2",
        "--node-rank", "1", "--store", "no-such-host.invalid:29500", *FAST, "--",
        str(TRAINER)], 1, SUP, ["cannot resolve the host 'no-such-host.invalid'"]),
    Row("store-not-host-port", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--nnodes",
        "2", "--node-rank", "1", "--store", "localhost", "--", str(TRAINER)], 2, SUP,
        ["--store localhost", "HOST:PORT"]),
    Row("node-rank-without-store", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--nnodes",
        "2", "--node-rank", "1", "--", str(TRAINER)], 2, SUP, ["--node-rank=1 needs --store"]),
    Row("node-zero-with-store", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--nnodes",
        "2", "--store", "127.0.0.1:29500", "--", str(TRAINER)], 2, SUP,
        ["--store 127.0.0.1:29500 with --node-rank 0"]),
    Row("second-node-never-starts", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--nnodes",
        "2", *FAST, "--", str(TRAINER), "--mock-data", "--mecefo"], 1, SUP,
        ["node 1 of --nnodes=2 did not join within --init-timeout=2s", "--node-rank 1"],
        check=_waited_for_nodes),
    Row("script-missing", "launch", [*SUPERVISOR, "--nproc-per-node", "2", "--",
        "examples/pretrain_gpt/pretrain.py"], 2, SUP,
        ["examples/pretrain_gpt/pretrain.py: no such file"]),
    Row("rank-flag-error-supervised", "launch", supervised("--mock-data", "--mecefo", "--lr",
        "-1"), 2, SUP, ["start-up failure", "before training started", "--lr=-1.0",
                        "nothing to resume"]),
    Row("rejoin-on-node-zero", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--rejoin",
        "--", str(TRAINER)], 2, SUP, ["--rejoin --node-rank=0"]),
    Row("store-mode-replicated-removed", "launch", [*SUPERVISOR, "--nproc-per-node", "1",
        "--nnodes", "2", "--store-mode", "replicated", "--", str(TRAINER)], 2, SUP,
        ["argument --store-mode: 'replicated' was removed",
         "--store-mode etcd --etcd HOST:PORT,...", "docs/cluster.md"]),
    # ----------------------------------------------- launch: the etcd mode as a user meets it
    # One block: the rows of the etcd user path (an https endpoint, an etcd:// --store in the
    # single mode, the etcd client missing, a key prefix that nodes derive apart or that holds
    # a live job). The rows that reach etcd run a private cluster (the ``etcd`` fixture).
    Row("etcd-https-endpoint", "launch", [*SUPERVISOR, "--nproc-per-node", "1", "--store-mode",
        "etcd", "--etcd", "https://127.0.0.1:2379", "--", str(TRAINER)], 2, SUP,
        ["--etcd https://127.0.0.1:2379", "TLS (https://) is not supported",
         "pass HOST:PORT (e.g. --etcd 127.0.0.1:2379)"]),
    Row("etcd-store-without-store-mode", "launch", [*SUPERVISOR, "--nproc-per-node", "1",
        "--nnodes", "2", "--node-rank", "1", "--store",
        "etcd://127.0.0.1:2379,127.0.0.1:2381/mecefo/j?ttl=8", "--", str(TRAINER)], 2, SUP,
        ["an etcd:// address is the store of --store-mode etcd",
         "add --store-mode etcd --etcd 127.0.0.1:2379,127.0.0.1:2381"]),
    Row("etcd-client-missing", "launch", [PY, "-c", WITHOUT_ETCD_CLIENT, "--nproc-per-node",
        "1", "--store-mode", "etcd", "--etcd", "127.0.0.1:2379", "--", str(TRAINER)], 1, SUP,
        ["--store-mode etcd needs the etcd client etcd-sdk-python", "pip install -e .",
         "etcd-sdk-python>=0.0.7"]),
    Row("etcd-store-port-on-node-0-only", "launch", [*SUPERVISOR, "--nproc-per-node", "1",
        "--nnodes", "2", "--store-mode", "etcd", "--etcd", "{etcd}", "--store-port",
        "{free_port}", *FAST, "--", str(TRAINER), "--mock-data"], 1, SUP,
        ["node 1 of --nnodes=2 did not join within --init-timeout=2s",
         "start its supervisor with --node-rank 1 --store-mode etcd --etcd {etcd} and the same "
         "command, --nnodes and --nproc-per-node"], NO_JOB_ID, needs=("etcd", "busy_port"),
        check=_no_etcd_store_flag),
    Row("etcd-node-finds-no-leader", "launch", [*SUPERVISOR, "--nproc-per-node", "1",
        "--nnodes", "2", "--node-rank", "1", "--store-mode", "etcd", "--etcd", "{etcd}",
        *FAST, "--", str(TRAINER), "--mock-data", "--train-iters", "3"], 1, SUP,
        ["node 1: no leader published a membership store under /mecefo/cmd-",
         "within --init-timeout=2s", "start node 0's supervisor with the same command"],
        NO_JOB_ID, needs=("etcd",)),
    Row("etcd-prefix-holds-live-job", "launch", [*SUPERVISOR, "--nproc-per-node", "1",
        "--store-mode", "etcd", "--etcd", "{etcd}", *FAST, "--", str(TRAINER), "--mock-data"],
        1, SUP, ["the etcd key prefix /mecefo/{live_job} holds a live job",
                 "MECEFO_JOB_ID={live_job}", "export MECEFO_JOB_ID=<a name unique to this job>"],
        {"MECEFO_JOB_ID": "{live_job}"}, needs=("etcd", "live_job"), check=_live_job_kept),
    # ------------------------------------------------------------- signals and time limits
    Row("sup-ctrl-c", "signals", SUPERVISED_LONG, 130, STOPPED,
        ["SIGINT", "2 ranks and 1 standbys ended", "--exit-signal-handler"],
        action=_signal(signal.SIGINT), slow=True, timeout=300),
    Row("sup-ctrl-c-waiting-for-nodes", "signals", [*SUPERVISOR, "--nproc-per-node", "1",
        "--nnodes", "2", "--store-file", "{tmp}/store.txt", "--", str(TRAINER)], 130, STOPPED,
        ["SIGINT"], action=_signal_when_file("store.txt", signal.SIGINT)),
    Row("sup-ctrl-c-twice", "signals", SUPERVISED_LONG, 130, STOPPED, ["second SIGINT"],
        action=_signal(signal.SIGINT, signal.SIGINT), slow=True, timeout=300),
    Row("sup-sigterm", "signals", SUPERVISED_LONG, 143, STOPPED, ["SIGTERM", "ended"],
        action=_signal(signal.SIGTERM), slow=True, timeout=300),
    Row("sup-sigterm-saves", "signals", [*SUPERVISED_LONG, "--exit-signal-handler", "--save",
        "{tmp}/save"], 0, STOPPED, ["SIGTERM", "2 ranks saved and exited"],
        action=_signal(signal.SIGTERM), check=_saved, slow=True, timeout=300),
    Row("sup-rank-dies-while-saving", "signals", [*SUPERVISOR, "--nproc-per-node", "2",
        "--replace", "immediately", "--pid-file", "{tmp}/pids", "--", str(TRAINER),
        *TRAIN_LONG, "--mecefo", "--mecefo-rank", "16", "--exit-signal-handler", "--save",
        "{tmp}/save"], 143, STOPPED, ["SIGTERM", "before their save completed"],
        action=_term_then_kill_rank_1, check=_not_recovered, slow=True, timeout=300),
    Row("trainer-ctrl-c", "signals", trainer(*TRAIN_LONG), 130, TP,
        ["interrupted (Ctrl-C)", "--exit-signal-handler"], action=_signal(signal.SIGINT),
        slow=True, timeout=300),
    Row("trainer-sigterm-saves", "signals", trainer(*TRAIN_LONG, "--exit-signal-handler",
        "--save", "{tmp}/save"), 0, EXITING, ["SIGTERM received", "saving a checkpoint"],
        action=_signal(signal.SIGTERM), check=_saved, slow=True, timeout=300),
    Row("trainer-duration-saves", "signals", [PY, "-m", "torch.distributed.run",
        "--nproc_per_node=2", "--master_port={free_port}", str(TRAINER), *MOCK,
        "--train-iters", "1000", "--exit-duration-in-mins", "0.0001", "--save", "{tmp}/save"],
        0, EXITING, ["at iteration 1:", "--exit-duration-in-mins=0.0001 has passed"],
        needs=("busy_port",), check=_saved, slow=True, timeout=300),
    # ------------------------------------------------------------- the Megatron-LM adapter
    # Megatron-LM's own pretrain_gpt.py (core_v0.16.1, patched): the plugin's flag checks run
    # in Megatron-LM's parser, before its validate_args and before any process group.
    Row("mlm-rank-not-positive", "flags", megatron_lm("--mecefo", "--mecefo-rank", "0"), 2, TP,
        ["--mecefo-rank=0", "positive"], rank_env(), needs=("mlm",), startup_s=60),
    Row("mlm-flag-without-mecefo", "flags", megatron_lm("--mecefo-rank", "16"), 2, TP,
        ["--mecefo-rank=16", "without --mecefo"], rank_env(), needs=("mlm",), startup_s=60),
    Row("mlm-replica-beyond-dp", "flags", megatron_lm("--mecefo", "--mecefo-rank", "16",
        "--mecefo-fail", "5:1:2"), 2, TP, ["--mecefo-fail", "replica 5", "only 2"],
        rank_env(), needs=("mlm",), startup_s=60),
    Row("mlm-kill-without-supervisor", "flags", megatron_lm("--mecefo", "--mecefo-rank", "16",
        "--mecefo-kill", "1:3:backward"), 2, TP, ["--mecefo-kill=1:3:backward",
        "recovery.supervisor"], rank_env(), needs=("mlm",), startup_s=60),
    Row("mlm-save-unwritable", "flags", megatron_lm("--mecefo", "--mecefo-rank", "16",
        "--save", "/proc/mecefo_ckpt"), 2, TP, ["--save /proc/mecefo_ckpt", "cannot write"],
        rank_env(), needs=("mlm",), startup_s=60),
    # Issue 45: four mistakes that used to end in argparse's "unrecognized arguments", in an
    # IndexError on every rank, or in a run that quietly did less than asked.
    Row("mlm-without-patch", "flags", megatron_lm("--mecefo", "--mecefo-rank", "16",
        "--pretrain-script", "{mlm_stock}"), 2, TP,
        ["--mecefo: ", "does not have the MeCeFO patch", "git apply", "megatron-lm-<tag>.patch"],
        rank_env(), needs=("mlm", "mlm_stock"), startup_s=60),
    Row("mlm-abft-layer-beyond-model", "flags", megatron_lm("--mecefo-abft-inject",
        "kind=inf,op=scores,layer=9,iter=2"), 2, TP,
        ["--mecefo-abft-inject 'kind=inf,op=scores,layer=9,iter=2'", "layer 9 does not exist",
         "layers 1..2", "never fire"], rank_env(), needs=("mlm",), startup_s=60),
    Row("mlm-iterations-to-skip", "flags", megatron_lm("--mecefo", "--mecefo-rank", "16",
        "--iterations-to-skip", "2"), 2, TP,
        ["--mecefo with --iterations-to-skip 2", "without an optimizer step",
         "drop --iterations-to-skip"], rank_env(), needs=("mlm",), startup_s=60),
    Row("mlm-data-other-tokenizer", "data", megatron_lm("--mecefo", "--mecefo-rank", "16",
        "--mecefo-policy", "drop", "--data-path", "{data}/foreign", "--split", "100,0,0",
        mock=False), 1, TP,
        ["--data-path", "token id 50000", "read all of", "NullTokenizer vocabulary (129 ids)",
         "another tokenizer"],
        {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": "{free_port}"}, needs=("mlm", "data", "busy_port"), startup_s=90),
    Row("mlm-start-up-failure-supervised", "flags", [*SUPERVISOR, "--nproc-per-node", "2",
        *FAST, "--", *megatron_lm("--mecefo", "--mecefo-rank", "0")[1:]], 2, SUP,
        ["start-up failure", "rank 0", "--mecefo-rank=0", "nothing to resume"],
        needs=("mlm",), startup_s=60),
]  # fmt: skip
