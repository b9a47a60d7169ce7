"""Check a ``patches/`` patch against a Megatron-LM checkout, then train with it.

    python patches/verify_patch.py /path/to/Megatron-LM [--tag core_v0.16.1] [--nproc 4]

1. ``git apply --check`` of ``patches/megatron-lm-<tag>.patch`` in the checkout (nothing in
   the checkout is changed).
2. The patch is applied to a copy of ``pretrain_gpt.py`` in a temporary folder.
3. The patched script trains a tiny GPT on mock data for 6 iterations with ``--mecefo`` and a
   scripted failure (replica 1 down for iterations 2-4), as DP4 on 4 ranks. On a machine
   without CUDA it runs through ``patches/run_megatron_lm_cpu.py`` (the plugin's CPU runtime,
   gloo). The MeCeFO log lines and the summary must appear.
4. Unless ``--no-identity-check``: the patched script with ``--mecefo`` and no failures must
   print the same losses as the unpatched script without it.

Running needs the megatron-core release of the tag (0.16.x for core_v0.16.1; core_v0.19.0
needs megatron-core 0.19, i.e. Python >= 3.12); otherwise only step 1 runs, and the script
says so. ``megatron/training`` also needs ``pip install megatron-mecefo[megatron-lm]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TAGS = ("core_v0.16.1", "core_v0.19.0")

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "6",
    "--log-interval", "1", "--lr", "1e-3", "--lr-decay-style", "constant",
    "--eval-iters", "0", "--eval-interval", "1000",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--seed", "1234",
]  # fmt: skip
CPU = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
]  # fmt: skip
MECEFO = ["--mecefo", "--mecefo-rank", "16"]
FAILURE = ["--mecefo-fail", "1:2:5"]
EXPECTED = [
    r"> MeCeFO: policy neighbor, scripted: 1:2:5; failure units: replica 0: ranks \[0\]; "
    r"replica 1: ranks \[1\]",
    r"> MeCeFO: iteration 2: replicas \[1\] down; policy neighbor: neighbours 1->2, "
    r"micro-batches per replica \[2, 0, 4, 2\], 4 in takeover mode, MHA exact fraction 0.50",
    r"> MeCeFO: iteration 5: every replica up again",
    r"iteration\s+6/\s+6",
    r"> MeCeFO summary: 3 degraded iterations \(0 with a fallback\), samples processed 96 / "
    r"skipped 0",
]


def _say(line: str) -> None:
    print(f"verify_patch: {line}", flush=True)


def _detect_tag(checkout: str) -> str:
    proc = subprocess.run(
        ["git", "-C", checkout, "describe", "--tags", "--exact-match"],
        capture_output=True,
        text=True,
    )
    tag = proc.stdout.strip()
    if proc.returncode != 0 or tag not in TAGS:
        sys.exit(f"verify_patch: cannot tell the checkout's tag ({tag or 'none'}); pass --tag")
    return tag


def _run(cmd: list[str], env: dict, timeout: int) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(out.splitlines()[-40:])
        sys.exit(f"verify_patch: training failed (exit {proc.returncode}):\n{tail}")
    return out


def _losses(output: str) -> list[str]:
    return re.findall(r"lm loss: ([0-9.E+-]+)", output)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkout", help="a Megatron-LM checkout (its top folder)")
    p.add_argument("--tag", choices=TAGS, default=None, help="default: from git describe")
    p.add_argument("--nproc", type=int, default=4, help="ranks (DP = nproc)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--no-identity-check", action="store_true")
    a = p.parse_args()
    checkout = os.path.abspath(a.checkout)
    tag = a.tag or _detect_tag(checkout)
    patch = os.path.join(HERE, f"megatron-lm-{tag}.patch")

    name = os.path.basename(patch)
    check = subprocess.run(
        ["git", "apply", "--check", "-v", patch], cwd=checkout, capture_output=True, text=True
    )
    already = False
    if check.returncode != 0:
        reverse = subprocess.run(
            ["git", "apply", "--check", "--reverse", patch],
            cwd=checkout,
            capture_output=True,
            text=True,
        )
        if reverse.returncode != 0:
            sys.exit(
                f"verify_patch: {name} does not apply to {checkout}, and is not applied there "
                f"either; check out the tag it is for ({tag}) with an unmodified "
                f"pretrain_gpt.py:\n{check.stderr}"
            )
        already = True
        _say(f"{name} is already applied in {checkout}: checking that patched script")
    else:
        _say(f"git apply --check {name} in {checkout}: OK")

    import megatron.core

    version = megatron.core.__version__
    wanted = tag.removeprefix("core_v").rsplit(".", 1)[0]  # "0.16" / "0.19"
    if not version.startswith(wanted):
        _say(
            f"NOT RUN: the {tag} training loop needs megatron-core {wanted}.x, and this "
            f"environment has {version}; only the patch check above ran"
        )
        return

    with tempfile.TemporaryDirectory(prefix="mecefo_verify_") as work:
        _train(a, checkout, patch, work, already)
    _say("PASSED")


def _train(a: argparse.Namespace, checkout: str, patch: str, work: str, already: bool) -> None:
    """Steps 2-4 in the temporary folder ``work`` (removed afterwards, also on failure)."""
    import torch

    stock_script = os.path.join(checkout, "pretrain_gpt.py")
    os.makedirs(os.path.join(work, "patched"))
    os.makedirs(os.path.join(work, "stock"))
    patched = os.path.join(work, "patched", "pretrain_gpt.py")
    shutil.copy(stock_script, patched)
    if already:  # the checkout holds the patched script; rebuild the stock one
        stock_script = os.path.join(work, "stock", "pretrain_gpt.py")
        shutil.copy(patched, stock_script)
        subprocess.run(["git", "apply", "--reverse", patch], cwd=os.path.dirname(stock_script))
    else:
        subprocess.run(["git", "apply", patch], cwd=os.path.dirname(patched), check=True)
    _say(f"patched copy: {patched}")

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    base = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.nproc}"]
    if torch.cuda.is_available():
        # The patched copy lives outside the checkout: megatron.training, gpt_builders etc.
        # come from the checkout through PYTHONPATH.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout, env.get("PYTHONPATH")]))
        launch = lambda script: base + [script] + MODEL  # noqa: E731
    else:
        runner = [os.path.join(HERE, "run_megatron_lm_cpu.py"), "--megatron-lm-dir", checkout]
        launch = lambda script: base + runner + ["--pretrain-script", script] + MODEL + CPU  # noqa
        _say("no CUDA: running on CPU ranks over gloo through run_megatron_lm_cpu.py")

    out = _run(launch(patched) + MECEFO + FAILURE, env, a.timeout)
    print("\n".join(line for line in out.splitlines() if "MeCeFO" in line or "iteration " in line))
    missing = [pattern for pattern in EXPECTED if not re.search(pattern, out)]
    if missing:
        sys.exit(f"verify_patch: FAILED, missing from the output: {missing}")
    _say(f"--mecefo with a scripted failure: OK ({len(_losses(out))} iterations logged)")

    if not a.no_identity_check:
        stock = _losses(_run(launch(stock_script), env, a.timeout))
        mecefo = _losses(_run(launch(patched) + MECEFO, env, a.timeout))
        if not stock or stock != mecefo:
            sys.exit(f"verify_patch: FAILED, losses differ: stock {stock}, --mecefo {mecefo}")
        _say(f"--mecefo without failures = unpatched, loss for loss: OK ({', '.join(stock)})")


if __name__ == "__main__":
    main()
