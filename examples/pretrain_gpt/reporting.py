"""What a run prints and writes: Megatron-LM's log lines (start, every ``--log-interval``,
validation), the records of ``--metrics-file`` (JSON lines) and ``--tensorboard-dir``, and the
summary table at the end. Rank 0 writes; the others stay silent.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional

Rows = list[tuple[str, str]]


class TrainingLog:
    """Rank 0's output: stdout lines, the metrics file and TensorBoard."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.metrics_file: Any = None
        self.tb: Any = None

    def open(self, args: Any, mode: str) -> None:
        """Open ``--metrics-file`` (``mode``: ``a`` where a resumed run appends) and
        ``--tensorboard-dir``, on rank 0."""
        if self.rank != 0:
            return
        if args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
            self.metrics_file = open(args.metrics_file, mode)
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=args.tensorboard_dir)

    def print(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def emit(self, record: dict[str, Any]) -> None:
        """One record to the metrics file, and its scalars to TensorBoard."""
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.tb is not None and "loss" in record:
            prefix = "train" if record["type"] == "train" else record["split"]
            for key in ("loss", "grad_norm", "lr", "tokens_per_s", "ppl"):
                if key in record:
                    self.tb.add_scalar(f"{prefix}/{key}", record[key], record["iteration"])

    def train_iterations_from(self, first: int) -> set[int]:
        """The ``train`` records' iterations ``>= first`` already in the metrics file, read
        from its end back to the first older record (empty without a file)."""
        if self.metrics_file is None:
            return set()
        iterations: list[Optional[int]] = []
        with open(self.metrics_file.name, "rb") as f:
            end = start = f.seek(0, os.SEEK_END)
            while start > 0 and not any(it is not None and it < first for it in iterations):
                start = max(0, start - (1 << 16))
                f.seek(start)
                lines = f.read(end - start).split(b"\n")
                # The first line of a chunk that starts mid-file may be cut: the next read
                # (from further back) has it whole.
                iterations = [_train_iteration(x) for x in (lines[1:] if start else lines)]
        return {it for it in iterations if it is not None and it >= first}

    def start(self, args: Any, device_type: str, num_params: int) -> None:
        """The line that names the layout, the model and the batch."""
        a = args
        vpp = a.virtual_pipeline_model_parallel_size
        backend = "gloo" if device_type == "cpu" else "nccl"
        self.print(
            f"> training GPT: TP{a.tensor_model_parallel_size} x "
            f"PP{a.pipeline_model_parallel_size} x DP{a.data_parallel_size}"
            f"{f' x VPP{vpp}' if vpp else ''}"
            f" on {a.world_size} {device_type} ranks ({backend}), "
            f"{'every replica simulated in this process, ' if a.mecefo_virtual_replicas else ''}"
            f"{a.num_layers} layers, hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, "
            f"{a.num_attention_heads} heads, seq {a.seq_length}, vocab {a.padded_vocab_size}, "
            f"{num_params:,} params on rank 0, spec {a.transformer_impl}; "
            f"global batch {a.global_batch_size} = {a.num_microbatches} micro-batches x "
            f"{a.micro_batch_size} x DP{a.data_parallel_size}"
        )

    def window(self, args: Any, window: list[dict[str, Any]]) -> None:
        """Megatron-LM's training log line over the iterations since the last one."""
        a = args
        last = window[-1]

        def mean(key: str) -> Optional[float]:
            # Iterations without an update (every replica down) have no loss: leave them out.
            values = [r[key] for r in window if r[key] is not None and not math.isnan(r[key])]
            return sum(values) / len(values) if values else None

        loss, grad_norm = mean("loss"), mean("grad_norm")
        # As Megatron-LM: a window of skipped iterations only shows the skipped count.
        loss_text = "" if loss is None else f" lm loss: {loss:.6E} |"
        norm_text = "" if grad_norm is None else f" grad norm: {grad_norm:.3f} |"

        tokens_per_s = sum(r["tokens"] for r in window) / sum(r["step_time_s"] for r in window)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.print(
            f" [{stamp}] iteration {last['iteration']:>8d}/{a.train_iters:>8d} |"
            f" consumed samples: {last['consumed_samples']:>10d} |"
            f" elapsed time per iteration (ms): {1000 * mean('step_time_s'):.1f} |"
            f" learning rate: {last['lr']:.6E} |"
            f" global batch size: {a.global_batch_size:>5d} |"
            f"{loss_text}{norm_text}"
            f" tokens/s: {tokens_per_s:.0f} |"
            f" number of skipped iterations: {sum(r['skipped'] for r in window):>3d} |"
            + mecefo_window(window)
        )

    def eval(self, record: dict[str, Any]) -> None:
        """Emit a validation record and print Megatron-LM's boxed line."""
        self.emit(record)
        line = (
            f" validation loss at iteration {record['iteration']} | lm loss value: "
            f"{record['loss']:.6E} | lm loss PPL: {record['ppl']:.6E} |"
        )
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))

    def summary(self, rows: Rows) -> None:
        """The training summary table (rank 0)."""
        if self.rank != 0:
            return
        width = max(len(k) for k, _ in rows)
        print("=" * 30 + " training summary " + "=" * 30)
        for key, value in rows:
            print(f" {key:<{width}}  {value}")
        print("=" * 78, flush=True)

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.tb is not None:
            self.tb.close()


def mecefo_window(window: list[dict[str, Any]]) -> str:
    """The MeCeFO part of a log line: the window's degraded iterations and the last plan."""
    if "mecefo" not in window[-1]:
        return ""
    m = window[-1]["mecefo"]
    degraded = sum(r["mecefo"]["degraded"] for r in window)
    text = f" mecefo degraded iterations: {degraded:>3d} |"
    if m["degraded"]:
        text += (
            f" failed replicas: {m['failed_replicas']} | takeover micro-batches:"
            f" {m['takeover_microbatches']} | MHA exact fraction:"
            f" {m['mha_exact_fraction']:.2f} |"
        )
    errors = [r["mecefo"]["grad_rel_error"] for r in window if "grad_rel_error" in r["mecefo"]]
    if errors:
        text += f" grad rel error: {errors[-1]:.3f} |"
    return text


def run_rows(
    args: Any,
    device_type: str,
    history: list[dict[str, Any]],
    consumed_samples: int,
    evals: list[dict[str, Any]],
) -> Rows:
    """The summary's rows for any run: layout, iterations, loss, speed, validation."""
    a = args
    steady = history[1:] or history  # the first step pays one-off costs
    step_s = sum(r["step_time_s"] for r in steady) / len(steady)
    throughput = sum(r["tokens"] for r in steady) / sum(r["step_time_s"] for r in steady)
    rows = [
        (
            "layout",
            f"TP{a.tensor_model_parallel_size} x PP{a.pipeline_model_parallel_size}"
            f" x DP{a.data_parallel_size} ({a.world_size} ranks, {device_type})",
        ),
        (
            "iterations",
            f"{history[0]['iteration']} -> {history[-1]['iteration']}"
            f" ({consumed_samples} samples consumed)",
        ),
        ("lm loss first -> last", first_last_loss(history)),
        ("mean step time", f"{step_s:.3f} s (iterations after the first)"),
        ("throughput", f"{throughput:,.0f} tokens/s (processed tokens)"),
    ]
    if evals:
        ev = evals[-1]
        rows.append(
            (
                "validation loss / ppl",
                f"{ev['loss']:.4f} / {ev['ppl']:.2f}" f" (iteration {ev['iteration']})",
            )
        )
    return rows


def mecefo_rows(controller: Any, history: list[dict[str, Any]]) -> Rows:
    """The summary's MeCeFO rows: policy, degraded iterations, takeover, gradient error."""
    recs = [r["mecefo"] for r in history]
    degraded = [r for r in history if r["mecefo"]["degraded"]]
    healthy = [r for r in history[1:] if not r["mecefo"]["degraded"]]
    mean = lambda rs: sum(r["step_time_s"] for r in rs) / len(rs)  # noqa: E731
    rows = [
        ("mecefo policy", f"{controller.policy.name} ({controller.schedule.description})"),
        (
            "degraded iterations",
            f"{len(degraded)} of {len(history)}"
            f" ({sum(bool(r['fallback']) for r in recs)} with a fallback,"
            f" {sum(r['no_update'] for r in recs)} without an update)",
        ),
        (
            "samples processed / skipped",
            f"{sum(r['samples_processed'] for r in recs)}"
            f" / {sum(r['samples_skipped'] for r in recs)}",
        ),
        ("takeover micro-batches", f"{sum(r['takeover_microbatches'] for r in recs)}"),
    ]
    if degraded and healthy:
        rows.append(
            (
                "step time healthy/degraded",
                f"{mean(healthy):.3f} s / {mean(degraded):.3f} s"
                f" (x{mean(degraded) / mean(healthy):.2f}; ranks share the CPU cores,"
                " so this is total work, not the critical path)",
            )
        )
    errors = [r["grad_rel_error"] for r in recs if "grad_rel_error" in r]
    if errors:
        rows.append(
            (
                "grad rel error",
                f"mean {sum(errors) / len(errors):.3f}, max {max(errors):.3f}"
                f" ({len(errors)} measurements)",
            )
        )
    return rows


def first_last_loss(history: list[dict[str, Any]]) -> str:
    """First and last loss of the iterations that computed one (not the skipped ones)."""
    losses = [r["loss"] for r in history if r["loss"] is not None]
    return f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "none (no iteration updated)"


def _train_iteration(line: bytes) -> Optional[int]:
    """The iteration of a whole ``train`` record line; None for any other line (a record cut
    short by its writer's death is no record)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if isinstance(record, dict) and record.get("type") == "train":
        return record.get("iteration")
    return None
