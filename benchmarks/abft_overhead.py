"""Attention-ABFT overhead: forward+backward time with and without the checksums.

Builds a LLaMA-style megatron-core ``GPTModel`` (RMSNorm, SwiGLU, RoPE, no biases, fp32) from
the local spec, once stock and once through ``abft_spec``, with the same weights, and times
forward + backward of (a) one transformer layer on random hidden states ``[seq, mbs, h]`` and
(b) a whole micro-batch through the model (embedding to loss), in three variants:

- ``off``: the stock spec;
- ``full``: ``--mecefo-abft`` (two checksum vectors, correction, second direction on demand);
- ``detect``: detection-only mode (one checksum vector, recompute on a mismatch).

No fault is injected: this is the price of protection. The variants run round-robin in every
round on the same input, so each ratio ``time(variant) / time(off)`` is measured side by side;
the JSON has the median of the per-round ratios and the per-variant medians. Ratios use CPU
time (see ``_timed``); wall times are recorded beside them.

Usage (repo root): ``.venv/bin/python benchmarks/abft_overhead.py [--shapes demo h512-s1024]``.
Writes ``results/abft_overhead.json`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_mecefo.runtime import CpuRuntime, quiet_cpu_warnings  # noqa: E402

SHAPES = {  # name: (layers, hidden, heads, seq, micro-batch)
    "demo": (4, 128, 4, 128, 2),  # make demo's model
    "h512-s1024": (4, 512, 8, 1024, 1),
}
VARIANTS = ("off", "full", "detect")


def _config(layers: int, hidden: int, heads: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=max(64, int(8 * hidden / 3 / 64) * 64), normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, pipeline_dtype=torch.float32,
    )  # fmt: skip


def _models(shape: str) -> Dict[str, Any]:
    from megatron.core.models.gpt import GPTModel

    from megatron_mecefo.abft import AbftConfig, AbftState, abft_spec, apply_abft
    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec

    layers, hidden, heads, seq, _ = SHAPES[shape]
    config = _config(layers, hidden, heads)
    stock = gpt_decoder_spec(config, "local")
    models = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        spec = stock if variant == "off" else abft_spec(stock)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=384,
                         max_sequence_length=seq, position_embedding_type="rope")  # fmt: skip
        if variant != "off":
            mode = "correct" if variant == "full" else "detect"
            model.abft_state = AbftState(AbftConfig(mode=mode))
            apply_abft(model, model.abft_state)
        models[variant] = model
    sd = models["off"].state_dict()
    for m in models.values():
        m.load_state_dict(sd)
    return models


def _timed(fn: Callable[[], None]) -> Tuple[float, float]:
    """(CPU seconds, wall seconds) of one call. The ratios use CPU time: with one torch
    thread the step's work is this process's CPU time, which other jobs on a shared machine
    do not inflate the way they inflate wall time."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def run_shape(shape: str, rounds: int) -> Dict[str, Any]:
    _, hidden, _, seq, mbs = SHAPES[shape]
    models = _models(shape)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 384, (mbs, seq + 1), generator=gen)
    pos = torch.arange(seq).expand(mbs, seq)
    hidden_states = torch.randn(seq, mbs, hidden, generator=gen)
    grad_out = torch.randn(seq, mbs, hidden, generator=gen)

    def layer_step(model) -> Callable[[], None]:
        layer = model.decoder.layers[0]
        rope = model.rotary_pos_emb(seq)

        def step() -> None:
            x = hidden_states.clone().requires_grad_(True)
            out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
            out.backward(grad_out)

        return step

    def model_step(model) -> Callable[[], None]:
        def step() -> None:
            model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean().backward()

        return step

    names = ("layers", "hidden", "heads", "seq", "mbs")
    result: Dict[str, Any] = {"shape": dict(zip(names, SHAPES[shape], strict=True))}
    for what, make in (("layer", layer_step), ("microbatch", model_step)):
        steps = {v: make(models[v]) for v in VARIANTS}
        for v in VARIANTS:  # warm-up (allocator, checksum weight caches)
            steps[v]()
        times: Dict[str, list] = {v: [] for v in VARIANTS}
        walls: Dict[str, list] = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for v in VARIANTS:
                for m in models.values():
                    m.zero_grad(set_to_none=True)
                cpu, wall = _timed(steps[v])
                times[v].append(cpu)
                walls[v].append(wall)
        ratios = {
            v: statistics.median(t / o for t, o in zip(times[v], times["off"], strict=True))
            for v in VARIANTS[1:]
        }
        result[what] = {
            "median_cpu_s": {v: statistics.median(times[v]) for v in VARIANTS},
            "median_wall_s": {v: statistics.median(walls[v]) for v in VARIANTS},
            "ratio": ratios,
            "overhead_pct": {v: 100 * (r - 1) for v, r in ratios.items()},
            "cpu_times_s": times,
            "wall_times_s": walls,
        }
    checks = models["full"].abft_state.counters.step_checks
    result["gemm_checks_in_last_step"] = checks
    return result


def summary(result: Dict[str, Any]) -> str:
    parts = []
    for shape, r in result["shapes"].items():
        o = {w: r[w]["overhead_pct"] for w in ("layer", "microbatch")}
        parts.append(
            f"{shape}: layer +{o['layer']['full']:.1f}% (detect +{o['layer']['detect']:.1f}%),"
            f" micro-batch +{o['microbatch']['full']:.1f}% (detect "
            f"+{o['microbatch']['detect']:.1f}%)"
        )
    return f"abft_overhead ({result['device']}, {result['threads']} thread(s)): " + "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=str(REPO / "results" / "abft_overhead.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    quiet_cpu_warnings()
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with CpuRuntime():
            from megatron.core import parallel_state as ps
            from megatron.core import tensor_parallel

            ps.initialize_model_parallel(tensor_model_parallel_size=1)
            tensor_parallel.model_parallel_cuda_manual_seed(1)
            shapes = {s: run_shape(s, args.rounds) for s in args.shapes}
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    result = {
        "benchmark": "abft_overhead",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": "cpu",
        "threads": args.threads,
        "rounds": args.rounds,
        "dtype": "float32",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "shapes": shapes,
        "note": "no GPU was available to this measurement; CPU only",
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result), flush=True)


if __name__ == "__main__":
    main()
