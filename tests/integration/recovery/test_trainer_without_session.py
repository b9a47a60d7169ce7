"""A trainer without MeCeFO's recovery session (as Megatron-LM's own ``pretrain_gpt.py``) under
the supervisor: when it finishes, the job exits 0."""

from __future__ import annotations


def test_trainer_without_session_that_finishes_exits_zero(tmp_path) -> None:
    """Megatron-LM's pretrain_gpt.py sets no "done": every rank exiting 0 is a finished run
    (the Slurm script would otherwise requeue a finished job)."""
    import subprocess
    import sys

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(2))\n"
        "dist.destroy_process_group()\n"
    )
    cmd = [sys.executable, "-m", "megatron_mecefo.recovery.supervisor", "--nproc-per-node", "2",
           "--", str(worker)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "training is not done" not in out
