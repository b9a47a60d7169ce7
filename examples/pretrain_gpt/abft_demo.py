"""``make demo-abft``: train with injected attention faults, with and without ``--mecefo-abft``.

Runs the example trainer three times on the same data and seed (TP2 with sequence parallelism
on 2 CPU ranks, 100 iterations, a fault every 10 iterations, each kind and each op in turn):

1. clean: no faults, no checks;
2. ``--mecefo-abft`` with the faults: every fault detected and corrected;
3. the faults without ``--mecefo-abft``: the unprotected baseline.

It prints run 2's summary (the ABFT counts) and a table of the three loss curves.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAULTS = [
    "kind=inf,op=scores,every=40,start=10",
    "kind=nan,op=context,every=40,start=20",
    "kind=near_inf,op=proj,every=40,start=30,rank=1",
    "kind=bitflip,op=qkv,every=40,start=40",
]
ARGS = [
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--data-path", "data/stdlib_text_document", "--split", "98,2,0",
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "100", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "10",
    "--log-interval", "20", "--eval-iters", "0",
]  # fmt: skip


def run(name: str, extra: list[str], out: Path, port: int) -> list[dict]:
    metrics = out / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={port}", "examples/pretrain_gpt/pretrain_gpt.py", *ARGS, *extra,
           "--metrics-file", str(metrics)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} run failed:\n{proc.stderr[-4000:]}")
    if name == "abft":
        lines = proc.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if "training summary" in line)
        print("\n".join(lines[start:]))
    return [json.loads(x) for x in metrics.read_text().splitlines() if '"train"' in x]


def main() -> None:
    out = REPO / "results" / "demo_abft"
    out.mkdir(parents=True, exist_ok=True)
    inject = [a for f in FAULTS for a in ("--mecefo-abft-inject", f)]
    print("> demo-abft: TP2 + SP on 2 CPU ranks, 100 iterations, a fault every 10 iterations")
    clean = run("clean", [], out, 29541)
    abft = run("abft", ["--mecefo-abft", *inject], out, 29542)
    bare = run("faults", inject, out, 29543)
    print(f"{'iteration':>9} | {'clean':>10} | {'abft+faults':>11} | {'faults, no abft':>15}")
    for c, a, b in zip(clean, abft, bare, strict=True):
        if c["iteration"] % 10 == 0:
            print(f"{c['iteration']:>9} | {c['loss']:>10.6f} | {a['loss']:>11.6f} | "
                  f"{b['loss']:>15.6f}")  # fmt: skip
    diff = max(abs(c["loss"] - a["loss"]) for c, a in zip(clean, abft, strict=True))
    corrected = sum(r["abft"]["corrected"] + r["abft"]["recomputed"] for r in abft)
    nan_at = next((r["iteration"] for r in bare if math.isnan(r["loss"])), None)
    print(
        f"> demo-abft: {corrected} faults repaired with --mecefo-abft, max |loss - clean| = "
        f"{diff:.2e}; without it the loss is NaN from iteration {nan_at}"
    )


if __name__ == "__main__":
    main()
