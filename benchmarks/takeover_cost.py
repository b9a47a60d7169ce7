"""Takeover cost: time and activation memory of a MeCeFO takeover micro-batch vs an exact one.

Builds a megatron-core ``TransformerBlock`` (LLaMA-style: RMSNorm, SwiGLU, RoPE, no biases)
from ``mecefo_spec(gpt_decoder_spec(config, impl))`` and times forward + backward of one
micro-batch of random hidden states ``[seq, mbs, hidden]`` in five modes:

- ``exact``: the stock path;
- ``skip``: takeover with ``skip_attention`` only;
- ``recompute``: takeover with ``recompute_ffn`` only;
- ``lowrank``: takeover with ``lowrank_ffn`` only;
- ``all``: takeover with all three (MeCeFO's neighbour mode).
- ``skip_lowrank``: takeover without FFN recomputation (what the recovery planner runs when
  memory allows it).

The modes run round-robin in every round on the same block and the same input, so each ratio
``c = time(mode) / time(exact)`` is measured side by side: ``c`` is the median over rounds of
the paired per-round ratio (ratios of medians and of minimums are in the JSON too, and a
monitor records whether other processes competed for the CPU meanwhile). Beside each
measured ratio stands a FLOP-model prediction (``flop_model``) and, for activation memory
(bytes autograd saves for backward), a prediction from the local spec's saved-tensor inventory
(``memory_model``). The basis V is computed once in warm-up (``basis_interval`` huge); its
one-off cost is timed separately. Finally a math-level measurement checks whether accumulating
the low-rank factor ``Gᵀ(XV)`` over k micro-batches and expanding ``· Vᵀ`` once per step would
pay (the plugin expands per micro-batch).

Usage (repo root): ``.venv/bin/python benchmarks/takeover_cost.py [--shape cpu-small]``.
Writes ``results/takeover_cost.json`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a plain script from the repo root, no install needed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_mecefo.runtime import CpuRuntime, quiet_cpu_warnings  # noqa: E402

MODES: Tuple[str, ...] = ("exact", "skip", "recompute", "lowrank", "all", "skip_lowrank")

# MecefoConfig switches of each mode; "exact" runs exact micro-batches, the rest takeovers.
MODE_TECHNIQUES: Dict[str, Dict[str, bool]] = {
    "exact": dict(skip_attention=True, recompute_ffn=True, lowrank_ffn=True),
    "skip": dict(skip_attention=True, recompute_ffn=False, lowrank_ffn=False),
    "recompute": dict(skip_attention=False, recompute_ffn=True, lowrank_ffn=False),
    "lowrank": dict(skip_attention=False, recompute_ffn=False, lowrank_ffn=True),
    "all": dict(skip_attention=True, recompute_ffn=True, lowrank_ffn=True),
    # A takeover without FFN recomputation: the recovery planner's choice when memory allows.
    "skip_lowrank": dict(skip_attention=True, recompute_ffn=False, lowrank_ffn=True),
}

# Mean count of other processes' runnable threads above which CPU timings are flagged.
CONTENDED = 0.5

# A huge τ: V is computed on first use (in warm-up) and never again inside timed iterations.
NO_REFRESH_INTERVAL = 10**9


@dataclass
class Shape:
    """Model and batch shape of one preset."""

    hidden: int
    ffn: int
    heads: int
    num_layers: int
    seq_length: int
    micro_batch_size: int
    rank: int
    note: str
    vocab: int = 32000
    """Vocabulary of the embedding and output layer (timed apart from the block: ``head``)."""


SHAPES: Dict[str, Shape] = {
    # The example trainer's default model, as benchmarks/degraded_throughput.py runs it:
    # SwiGLU FFN 320 (Megatron's 8h/3 rounded to 64), byte vocab padded to 384, mbs 1.
    "demo": Shape(128, 320, 4, 4, 128, 1, 32, "examples/pretrain_gpt default model", 384),
    # Small enough that the whole benchmark runs in well under 2 minutes on 2 CPU cores; rank
    # 32 of 256/688 so the low-rank gradient is genuinely low rank.
    "cpu-small": Shape(256, 688, 4, 2, 256, 2, 32, "LLaMA-style toy shape for CPU", 384),
    # GaLore's llama_1b config (mecefo-algorithm.md §8.1): h 2048, FFN 5461, 32 heads.
    "llama-1b": Shape(2048, 5461, 32, 2, 1024, 1, 128, "GaLore llama_1b widths, 2 of 24 layers"),
    "llama-7b": Shape(4096, 11008, 32, 2, 2048, 1, 128, "LLaMA-7B widths, 2 of 32 layers"),
}


# ------------------------------------------------------------------------------ FLOP model
def ffn_linears(h: int, i: int) -> List[Tuple[str, int, int]]:
    """(name, out m, in n) of the FFN weights of one SwiGLU layer: fc1 holds gate and up."""
    return [("fc1", 2 * i, h), ("fc2", h, i)]


def effective_rank(rank: int, m: int, n: int) -> int:
    """The plugin caps r per weight at min(out, in) (``compute_basis``)."""
    return min(rank, m, n)


def flop_model(shape: Shape, core_attention_factor: float) -> Dict[str, Any]:
    """Predicted matmul FLOPs of one micro-batch through the block, per mode.

    Per layer, T = seq·mbs tokens, MHA (kv = h), weights [out m, in n]:

    - attention projections, forward: QKV ``2·T·h·3h`` + output ``2·T·h·h`` = ``8·T·h²``;
    - core attention, forward: ``QKᵀ`` and ``P·V``, ``4·T·s·h``, times
      ``core_attention_factor`` (1.0: the local kernel computes the full s×s square and masks
      it; 0.5: a causal flash kernel skips the upper triangle);
    - FFN (SwiGLU), forward: fc1 ``2·T·h·2i`` + fc2 ``2·T·i·h`` = ``6·T·h·i``;
    - backward = 2 × forward (dgrad + wgrad for linears; two matmul grads each in the core).

    Takeover techniques change it as follows:

    - skip: attention forward only (no attention backward at all);
    - recompute: one extra FFN forward (the recomputation in backward);
    - lowrank, per FFN linear: the weight gradient ``2·T·m·n`` becomes ``X·V`` in forward
      (``2·T·n·r``) + ``Gᵀ·(XV)`` (``2·T·m·r``) + the expansion ``factor·Vᵀ`` (``2·m·n·r``,
      once per micro-batch);
    - all: all three; the recomputed FFN forward recomputes ``X·V`` too.

    Norms, RoPE, softmax and element-wise ops are not counted; being memory-bound, they are
    one reason measured time ratios can drift from these.
    """
    h, i, s = shape.hidden, shape.ffn, shape.seq_length
    T = s * shape.micro_batch_size
    attn_fwd = 8 * T * h * h + core_attention_factor * 4 * T * s * h
    ffn_fwd = 6 * T * h * i
    xv = gtxv = expand = 0.0
    for _, m, n in ffn_linears(h, i):
        r = effective_rank(shape.rank, m, n)
        xv += 2 * T * n * r
        gtxv += 2 * T * m * r
        expand += 2 * m * n * r
    ffn_wgrad = ffn_fwd  # exact weight gradients of fc1 + fc2
    ffn_dgrad = ffn_fwd
    lowrank_wgrad = gtxv + expand
    per_layer = {
        "exact": 3 * attn_fwd + 3 * ffn_fwd,
        "skip": attn_fwd + 3 * ffn_fwd,
        "recompute": 3 * attn_fwd + 4 * ffn_fwd,
        "lowrank": 3 * attn_fwd + (ffn_fwd + xv) + ffn_dgrad + lowrank_wgrad,
        "all": attn_fwd + 2 * (ffn_fwd + xv) + ffn_dgrad + lowrank_wgrad,
        "skip_lowrank": attn_fwd + (ffn_fwd + xv) + ffn_dgrad + lowrank_wgrad,
    }
    flops = {mode: shape.num_layers * f for mode, f in per_layer.items()}
    return {
        "description": (
            "matmul FLOPs per micro-batch; attention proj 8Th^2 + core 4Tsh*factor fwd, SwiGLU "
            "FFN 6Thi fwd, bwd = 2x fwd; skip = attention fwd only; recompute = +1 FFN fwd; "
            "lowrank per FFN linear [m,n]: wgrad 2Tmn -> 2Tnr (XV, fwd) + 2Tmr (G^T XV) + 2mnr "
            "(expand, per micro-batch); all = combined, recompute also redoes XV"
        ),
        "core_attention_factor": core_attention_factor,
        "tokens_per_microbatch": T,
        "per_layer_components": {
            "attention_fwd": attn_fwd,
            "ffn_fwd": ffn_fwd,
            "ffn_wgrad_exact": ffn_wgrad,
            "lowrank_xv_fwd": xv,
            "lowrank_gtxv": gtxv,
            "lowrank_expand": expand,
        },
        "flops": flops,
        "c_predicted": {mode: flops[mode] / flops["exact"] for mode in MODES},
    }


def memory_model(shape: Shape, probs_factor: int = 1) -> Dict[str, Any]:
    """Predicted elements saved for backward per micro-batch, from the local spec's inventory.

    What autograd saves per token in megatron-core 0.16.1's local spec (MHA, dropout 0), read
    off ``saved_tensors_hooks`` on a small model:

    - attention: layer input h, RMSNorm ``x·rsqrt`` h, QKV input h, rotated q h and k h,
      the QKV output 3h (v is a view of it), context h, softmax probs ``heads·s``:
      ``9h + heads·s``;
    - FFN input (residual after attention) h;
    - FFN: RMSNorm ``x·rsqrt`` h, fc1 input h, fc1 output 2i, the ``up (+ glu offset)`` copy i,
      ``silu(gate)`` i, fc2 input i: ``2h + 5i``; low rank replaces the fc1 and fc2 inputs
      (h and i) by ``X·V`` (r each);
    - once per block: final-norm input h and its ``x·rsqrt`` h.

    ``probs_factor``: the probs term in parameter-dtype elements. 1 in fp32; 3 in bf16/fp16 with
    ``attention_softmax_in_fp32`` (softmax saves its fp32 output, ``P·V`` the bf16 cast).

    Skip saves only the FFN part; recompute replaces the FFN part by its input; all saves only
    the FFN input of each layer. Per-row norm statistics, RoPE tables and the causal mask are
    O(1) per token and are left out; V is held by the module anyway and is left out of the
    measurement too. Every saved tensor has the parameter dtype, so element ratios are byte
    ratios (but see ``probs_factor``). The TE spec saves differently (no s×s probs).
    """
    h, i, s, a, L = shape.hidden, shape.ffn, shape.seq_length, shape.heads, shape.num_layers
    T = s * shape.micro_batch_size
    r1 = effective_rank(shape.rank, 2 * i, h)
    r2 = effective_rank(shape.rank, h, i)
    attn = 9 * h + probs_factor * a * s
    ffn_in = h
    ffn = 2 * h + 5 * i
    ffn_lowrank = ffn - h - i + r1 + r2
    final = 2 * h
    per_token = {
        "exact": L * (attn + ffn_in + ffn) + final,
        "skip": L * (ffn_in + ffn) + final,
        "recompute": L * (attn + ffn_in) + final,
        "lowrank": L * (attn + ffn_in + ffn_lowrank) + final,
        "all": L * ffn_in + final,
        "skip_lowrank": L * (ffn_in + ffn_lowrank) + final,
    }
    elements = {mode: T * e for mode, e in per_token.items()}
    return {
        "description": (
            "local-spec saved-tensor inventory per token: attention 9h+heads*s, FFN input h, "
            "FFN 2h+5i (low rank: h and i inputs -> r each), final norm 2h; skip drops "
            "attention, recompute keeps only the FFN input, all keeps only the FFN inputs"
        ),
        "probs_factor": probs_factor,
        "elements": elements,
        "ratio_predicted": {mode: elements[mode] / elements["exact"] for mode in MODES},
    }


# ------------------------------------------------------------------------------ setup
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Megatron-style flags; shape fields default to the preset's."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu-small")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument(
        "--rank", type=int, default=None, help="r of the low-rank basis (default: the preset's)"
    )
    p.add_argument("--iters", type=int, default=20, help="timed rounds; each runs every mode once")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (>= 2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: auto")
    p.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="decoder spec; the memory model and core_attention_factor 1.0 assume local",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS", "2")),
        help="torch.set_num_threads (default: $OMP_NUM_THREADS, else 2)",
    )
    p.add_argument("--accumulate-k", type=int, default=4, help="micro-batches per step (k)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output", default="results/takeover_cost.json")
    args = p.parse_args(argv)
    if args.warmup < 2:
        p.error("--warmup must be >= 2 (the first round also computes the basis)")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch build sees no CUDA device")
    if args.iters < 1:
        p.error("--iters must be >= 1")
    return args


def resolve_shape(args: argparse.Namespace) -> Shape:
    """The preset with any flag overrides applied."""
    base = SHAPES[args.shape]
    return Shape(
        hidden=base.hidden,
        ffn=base.ffn,
        heads=base.heads,
        num_layers=args.num_layers or base.num_layers,
        seq_length=args.seq_length or base.seq_length,
        micro_batch_size=args.micro_batch_size or base.micro_batch_size,
        rank=args.rank or base.rank,
        note=base.note,
        vocab=base.vocab,
    )


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock timings cover them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_block(
    shape: Shape, dtype: torch.dtype, device: torch.device, impl: str
) -> Tuple[torch.nn.Module, torch.Tensor]:
    """A MeCeFO ``TransformerBlock`` and the RoPE table for ``shape``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec
    from megatron_mecefo.techniques.specs import mecefo_spec

    on_cpu = device.type == "cpu"
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=on_cpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    spec = mecefo_spec(gpt_decoder_spec(config, impl))
    block = TransformerBlock(config, spec).to(device)
    rope = RotaryEmbedding(config.kv_channels, 1.0, use_cpu_initialization=on_cpu)
    rotary_pos_emb = rope(shape.seq_length).to(device)
    return block, rotary_pos_emb


def make_states(rank: int) -> Dict[str, Any]:
    """One ``MecefoState`` per mode; all share the block and its cached V (same rank)."""
    from megatron_mecefo.techniques.config import MecefoConfig
    from megatron_mecefo.techniques.state import MecefoState

    return {
        mode: MecefoState(
            MecefoConfig(rank=rank, basis_interval=NO_REFRESH_INTERVAL, **MODE_TECHNIQUES[mode])
        )
        for mode in MODES
    }


# ------------------------------------------------------------------------------ measurements
class Runner:
    """Runs one micro-batch of the block in a given mode."""

    def __init__(
        self,
        block: torch.nn.Module,
        rotary_pos_emb: torch.Tensor,
        states: Dict[str, Any],
        x: torch.Tensor,
        grad_out: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.block, self.rotary_pos_emb, self.states = block, rotary_pos_emb, states
        self.x, self.grad_out, self.device = x, grad_out, device
        self.step = 0

    def _prepare(self, mode: str) -> None:
        from megatron_mecefo.techniques.apply import apply_mecefo

        # Re-binding walks the modules: done outside the timed region.
        state = self.states[mode]
        apply_mecefo(self.block, state)
        state.start_step(self.step, ["exact" if mode == "exact" else "takeover"])
        state.begin_microbatch(self.block)
        self.step += 1

    def _forward(self) -> torch.Tensor:
        return self.block(self.x, None, rotary_pos_emb=self.rotary_pos_emb)

    def _clear(self) -> None:
        self.block.zero_grad(set_to_none=True)
        self.x.grad = None

    def timed(self, mode: str) -> Tuple[float, float]:
        """(forward seconds, forward+backward seconds) of one micro-batch."""
        self._prepare(mode)
        sync(self.device)
        t0 = time.perf_counter()
        out = self._forward()
        sync(self.device)
        t1 = time.perf_counter()
        out.backward(self.grad_out)
        sync(self.device)
        t2 = time.perf_counter()
        del out
        self._clear()
        return t1 - t0, t2 - t0

    def saved_bytes(self, mode: str) -> int:
        """Activation bytes autograd saves in the forward (parameters and V left out)."""
        from megatron_mecefo.techniques.activation_bytes import SavedActivationBytes

        self._prepare(mode)
        with SavedActivationBytes(self.block) as saved:
            out = self._forward()
        out.backward(self.grad_out)
        del out
        self._clear()
        return saved.nbytes

    def cuda_memory(self, mode: str) -> Dict[str, int]:
        """Allocator bytes: held after forward, and peaks of forward and forward+backward."""
        self._prepare(mode)
        sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        out = self._forward()
        sync(self.device)
        held = torch.cuda.memory_allocated(self.device) - base
        peak_fwd = torch.cuda.max_memory_allocated(self.device) - base
        out.backward(self.grad_out)
        sync(self.device)
        peak_step = torch.cuda.max_memory_allocated(self.device) - base
        del out
        self._clear()
        return {"held_after_fwd": held, "peak_fwd": peak_fwd, "peak_fwd_bwd": peak_step}


class ContentionMonitor:
    """Samples how many other processes' threads are runnable while timings are taken.

    Every ``interval`` seconds a daemon thread reads the system-wide ``procs_running`` from
    ``/proc/stat`` and subtracts this process's own runnable threads (``/proc/self/task``).
    A mean well above 0 on a machine with few cores means the timings were disturbed. The load
    average is no substitute: it lags by a minute and counts this benchmark's own threads.
    Linux only; elsewhere ``summary()`` returns None.
    """

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.samples: List[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def sample() -> Optional[int]:
        """Runnable threads of other processes right now, or None if /proc is unreadable."""
        try:
            with open("/proc/stat") as f:
                running = next(int(ln.split()[1]) for ln in f if ln.startswith("procs_running"))
            own = 0
            for tid in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError):
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        # The state follows the parenthesised command name.
                        own += f.read().rsplit(")", 1)[1].split()[0] == "R"
            return max(running - own, 0)
        except (OSError, StopIteration, IndexError, ValueError):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            value = self.sample()
            if value is not None:
                self.samples.append(value)

    def __enter__(self) -> "ContentionMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> Optional[Dict[str, float]]:
        """Mean other-runnable count and the share of samples with any, or None."""
        if not self.samples:
            return None
        return {
            "samples": len(self.samples),
            "other_runnable_mean": statistics.fmean(self.samples),
            "share_of_samples_with_other_runnable": sum(v > 0 for v in self.samples)
            / len(self.samples),
        }


def time_basis(
    block: torch.nn.Module, rank: int, device: torch.device, repeats: int = 3
) -> Dict[str, Any]:
    """One-off cost of a V refresh: ``compute_basis`` for every FFN weight of the block."""
    from megatron_mecefo.techniques.config import MecefoConfig
    from megatron_mecefo.techniques.lowrank_basis import COLUMN, ROW, compute_basis

    config = MecefoConfig(rank=rank)
    per_weight: Dict[str, float] = {}
    for li, layer in enumerate(block.layers):
        for name, mode in (("linear_fc1", COLUMN), ("linear_fc2", ROW)):
            weight = getattr(layer.mlp, name).weight
            times = []
            for _ in range(repeats):
                sync(device)
                t0 = time.perf_counter()
                compute_basis(weight, mode, config, None)
                sync(device)
                times.append(time.perf_counter() - t0)
            per_weight[f"layers.{li}.mlp.{name}"] = statistics.median(times) * 1e3
    return {
        "method": config.basis_method,
        "dtype": config.basis_dtype,
        "per_weight_ms": per_weight,
        "refresh_ms": sum(per_weight.values()),
    }


def expand_per_microbatch(
    w_grad: torch.Tensor, g: torch.Tensor, xv: torch.Tensor, v: torch.Tensor, k: int
) -> None:
    """k micro-batches as the plugin runs them (fused form): ``W_grad += (Gᵀ XV) Vᵀ`` each."""
    for _ in range(k):
        w_grad.addmm_(g.t() @ xv, v.t())


def expand_accumulated(
    w_grad: torch.Tensor,
    factor: torch.Tensor,
    g: torch.Tensor,
    xv: torch.Tensor,
    v: torch.Tensor,
    k: int,
) -> None:
    """k micro-batches with the m×r factor accumulated: ``factor += Gᵀ XV``; one expansion."""
    factor.zero_()
    for _ in range(k):
        factor.addmm_(g.t(), xv)
    w_grad.addmm_(factor, v.t())


def time_accumulation(
    shape: Shape, dtype: torch.dtype, device: torch.device, k: int, rounds: int
) -> Dict[str, Any]:
    """Per-micro-batch expansion vs accumulating the m×r factor and expanding once per step.

    Both variants run as plain torch matmuls at the benchmark's fc1 and fc2 shapes (T tokens
    per micro-batch), interleaved, medians of ``rounds``. The per-micro-batch variant uses the
    fused ``addmm_`` (Megatron's gradient-accumulation-fusion path); the unfused path also
    allocates and adds a full m×n gradient, so the saving measured here is a lower bound.
    """
    T = shape.seq_length * shape.micro_batch_size
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    result: Dict[str, Any] = {"k": k, "rounds": rounds, "linears": {}}
    for name, m, n in ffn_linears(shape.hidden, shape.ffn):
        r = effective_rank(shape.rank, m, n)
        g, xv, v = rand(T, m), rand(T, r), rand(n, r)
        w_grad = torch.zeros(m, n, dtype=dtype, device=device)
        factor = torch.zeros(m, r, dtype=dtype, device=device)
        variants: Dict[str, Callable[[], None]] = {
            "per_microbatch": functools.partial(expand_per_microbatch, w_grad, g, xv, v, k),
            "accumulated": functools.partial(expand_accumulated, w_grad, factor, g, xv, v, k),
        }
        times: Dict[str, List[float]] = {label: [] for label in variants}
        for round_i in range(rounds + 1):  # round 0 warms up
            for label, fn in variants.items():
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                if round_i:
                    times[label].append(time.perf_counter() - t0)
        med = {label: statistics.median(ts) * 1e3 for label, ts in times.items()}
        result["linears"][name] = {
            "m": m,
            "n": n,
            "r": r,
            "tokens": T,
            "per_microbatch_ms_for_k": med["per_microbatch"],
            "accumulated_ms_for_k": med["accumulated"],
            "saved_ms_per_microbatch": (med["per_microbatch"] - med["accumulated"]) / k,
            "saved_flops_per_microbatch": 2 * m * n * r * (k - 1) / k,
        }
    linears = result["linears"].values()
    result["saved_ms_per_microbatch"] = shape.num_layers * sum(
        lin["saved_ms_per_microbatch"] for lin in linears
    )
    result["saved_flops_per_microbatch"] = shape.num_layers * sum(
        lin["saved_flops_per_microbatch"] for lin in linears
    )
    return result


# ------------------------------------------------------------------------------ main
def time_head(
    shape: Shape, dtype: torch.dtype, device: torch.device, rounds: int
) -> Dict[str, Any]:
    """Forward + backward of what a micro-batch runs outside the block, which takeover leaves.

    Embedding lookup, output layer (h -> vocab) and cross-entropy, as plain torch ops of the
    same shapes as the GPT model's; median of ``rounds`` after one warm-up.
    """
    gen = torch.Generator().manual_seed(0)
    T = shape.seq_length * shape.micro_batch_size
    emb = torch.randn(shape.vocab, shape.hidden, generator=gen).to(device, dtype)
    out_w = torch.randn(shape.vocab, shape.hidden, generator=gen).to(device, dtype)
    emb.requires_grad_(True)
    out_w.requires_grad_(True)
    tokens = torch.randint(shape.vocab, (T,), generator=gen).to(device)
    labels = torch.randint(shape.vocab, (T,), generator=gen).to(device)
    times = []
    for i in range(rounds + 1):
        sync(device)
        t0 = time.perf_counter()
        x = F.embedding(tokens, emb)
        loss = F.cross_entropy(F.linear(x, out_w).float(), labels)
        loss.backward()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
        emb.grad = out_w.grad = None
    return {
        "what": "embedding + output layer + cross-entropy, fwd+bwd, per micro-batch",
        "vocab": shape.vocab,
        "params": 2 * shape.vocab * shape.hidden,
        "time_ms_median": statistics.median(times) * 1e3,
    }


def time_optimizer(
    block: torch.nn.Module, head_params: int, device: torch.device, dtype: torch.dtype, rounds: int
) -> Dict[str, Any]:
    """One Adam step over the block's and the head's parameters (a fixed per-step cost).

    torch's Adam (the step megatron-core's FP32 optimizer wraps on CPU), on fp32 copies with
    random gradients; median of ``rounds`` after one warm-up.
    """
    gen = torch.Generator().manual_seed(0)
    sizes = [p.numel() for p in block.parameters()] + [head_params]
    params = [torch.zeros(n, device=device, dtype=torch.float32) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt = torch.optim.Adam(params, lr=1e-4)
    times = []
    for i in range(rounds + 1):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return {
        "what": "torch.optim.Adam step over the block + head parameters (fp32 master copies)",
        "params": sum(sizes),
        "time_ms_median": statistics.median(times) * 1e3,
    }


def versions() -> Dict[str, str]:
    """Versions and machine facts for the JSON."""
    import megatron.core

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
    }


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """The whole benchmark; returns the JSON-ready result."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = resolve_shape(args)
    T = shape.seq_length * shape.micro_batch_size
    started = time.perf_counter()

    torch.manual_seed(args.seed)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    block, rotary_pos_emb = build_block(shape, dtype, device, args.transformer_impl)
    block.train()
    states = make_states(shape.rank)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(shape.seq_length, shape.micro_batch_size, shape.hidden, generator=gen)
    x = x.to(device=device, dtype=dtype).requires_grad_(True)
    grad_out = torch.randn(x.shape, generator=gen).to(device=device, dtype=dtype)
    runner = Runner(block, rotary_pos_emb, states, x, grad_out, device)

    # Warm-up rounds, round-robin; the first takeover with lowrank_ffn computes V.
    warmup_ms: Dict[str, List[float]] = {m: [] for m in MODES}
    for _ in range(args.warmup):
        for mode in MODES:
            warmup_ms[mode].append(runner.timed(mode)[1] * 1e3)
    refreshes_after_warmup = sum(len(s.basis_refreshes) for s in states.values())

    # Timed rounds: modes interleaved so each ratio is measured side by side.
    fwd_ms: Dict[str, List[float]] = {m: [] for m in MODES}
    step_ms: Dict[str, List[float]] = {m: [] for m in MODES}
    gc.collect()
    gc.disable()  # a collection inside one mode's iteration would skew that mode only
    try:
        with ContentionMonitor() as monitor:
            for round_i in range(args.iters):
                # Each round starts one mode later, so no mode always runs after the same one.
                for j in range(len(MODES)):
                    mode = MODES[(round_i + j) % len(MODES)]
                    f, t = runner.timed(mode)
                    fwd_ms[mode].append(f * 1e3)
                    step_ms[mode].append(t * 1e3)
    finally:
        gc.enable()
    contention = monitor.summary()
    refreshes_in_timed = (
        sum(len(s.basis_refreshes) for s in states.values()) - refreshes_after_warmup
    )
    if refreshes_in_timed:
        raise RuntimeError(f"{refreshes_in_timed} basis refreshes inside timed iterations")

    saved = {mode: runner.saved_bytes(mode) for mode in MODES}
    cuda_mem = {mode: runner.cuda_memory(mode) for mode in MODES} if device.type == "cuda" else None
    basis = time_basis(block, shape.rank, device)
    median = {m: statistics.median(v) for m, v in step_ms.items()}
    basis["first_lowrank_warmup_minus_median_ms"] = warmup_ms["lowrank"][0] - median["lowrank"]
    basis["first_exact_warmup_minus_median_ms"] = warmup_ms["exact"][0] - median["exact"]
    basis["refresh_over_all_microbatch"] = basis["refresh_ms"] / median["all"]
    accumulation = time_accumulation(shape, dtype, device, args.accumulate_k, max(args.iters, 5))
    head = time_head(shape, dtype, device, max(args.iters, 5))
    optimizer = time_optimizer(block, head["params"], device, dtype, max(args.iters // 2, 5))
    # A whole micro-batch: the head costs the same in both modes, so it dilutes c.
    head_ms = head["time_ms_median"]
    per_microbatch = {
        "exact_ms": median["exact"] + head_ms,
        "takeover_ms": paired_c(step_ms, "all") * median["exact"] + head_ms,
        "takeover_no_recompute_ms": paired_c(step_ms, "skip_lowrank") * median["exact"] + head_ms,
    }
    per_microbatch["c"] = per_microbatch["takeover_ms"] / per_microbatch["exact_ms"]
    for mode in ("all", "lowrank"):
        accumulation[f"saved_fraction_of_{mode}_microbatch"] = (
            accumulation["saved_ms_per_microbatch"] / median[mode]
        )

    core_factor = 0.5 if args.transformer_impl == "transformer_engine" else 1.0
    flops = flop_model(shape, core_factor)
    accumulation["saved_flop_fraction_of_all_microbatch"] = (
        accumulation["saved_flops_per_microbatch"] / flops["flops"]["all"]
    )
    softmax_fp32 = dtype != torch.float32 and block.config.attention_softmax_in_fp32
    mem = memory_model(shape, probs_factor=3 if softmax_fp32 else 1)
    modes: Dict[str, Any] = {}
    for mode in MODES:
        modes[mode] = {
            "techniques": None if mode == "exact" else MODE_TECHNIQUES[mode],
            "time_ms_median": median[mode],
            "fwd_ms_median": statistics.median(fwd_ms[mode]),
            "time_ms": step_ms[mode],
            "warmup_ms": warmup_ms[mode],
            # Paired: each round's time over the same round's exact time; median over rounds.
            # Robust to slow drifts in machine load, which the ratio of medians is not.
            "c": paired_c(step_ms, mode),
            "c_ratio_of_medians": median[mode] / median["exact"],
            # Minimum times are the least disturbed by other processes on a shared machine.
            "c_ratio_of_minimums": min(step_ms[mode]) / min(step_ms["exact"]),
            "time_ms_min": min(step_ms[mode]),
            "c_predicted": flops["c_predicted"][mode],
            "saved_bytes": saved[mode],
            "memory_ratio": saved[mode] / saved["exact"],
            "memory_ratio_predicted": mem["ratio_predicted"][mode],
        }
        if cuda_mem is not None:
            modes[mode]["cuda_memory_bytes"] = cuda_mem[mode]
            modes[mode]["cuda_held_after_fwd_ratio"] = (
                cuda_mem[mode]["held_after_fwd"] / cuda_mem["exact"]["held_after_fwd"]
            )
    ps.destroy_model_parallel()
    return {
        "benchmark": "takeover_cost",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config": {
            "shape": args.shape,
            **asdict(shape),
            "tokens_per_microbatch": T,
            "attention": "MHA (num_query_groups = heads)",
            "model": "megatron-core TransformerBlock (decoder only, + final RMSNorm), MeCeFO spec",
            "transformer_impl": args.transformer_impl,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "iters": args.iters,
            "warmup": args.warmup,
            "basis_interval": NO_REFRESH_INTERVAL,
            "grad": "out.backward(fixed random grad), input requires grad",
            "seed": args.seed,
            **versions(),
        },
        "flop_model": flops,
        "memory_model": mem,
        "modes": modes,
        "basis": basis,
        "accumulation": accumulation,
        # Fixed per-micro-batch (head) and per-step (optimizer) costs; the gradient sync is
        # measured in the real multi-rank runs of benchmarks/degraded_throughput.py.
        "head": head,
        "optimizer": optimizer,
        "per_microbatch": per_microbatch,
        # Other processes' runnable threads during the timed rounds (see ContentionMonitor).
        "contention": contention,
        "wall_time_s": time.perf_counter() - started,
    }


def paired_c(step_ms: Dict[str, List[float]], mode: str) -> float:
    """Median over rounds of time(mode) / time(exact) of the same round."""
    return statistics.median(t / e for t, e in zip(step_ms[mode], step_ms["exact"], strict=True))


def summary(result: Dict[str, Any]) -> str:
    """The one-line summary printed at the end."""
    m = result["modes"]
    parts = [
        f"takeover_cost: shape={result['config']['shape']} device={result['config']['device']}"
    ]
    parts.append(f"c(all)={m['all']['c']:.2f} (FLOP model {m['all']['c_predicted']:.2f})")
    for mode in ("skip", "recompute", "lowrank"):
        parts.append(f"{mode}={m[mode]['c']:.2f} ({m[mode]['c_predicted']:.2f})")
    parts.append(
        f"saved-activation ratio(all)={m['all']['memory_ratio']:.3f} "
        f"(model {m['all']['memory_ratio_predicted']:.3f})"
    )
    pmb = result["per_microbatch"]
    parts.append(
        f"whole micro-batch with head (vocab {result['head']['vocab']}) c={pmb['c']:.2f}, "
        f"optimizer step {result['optimizer']['time_ms_median']:.1f} ms = "
        f"{result['optimizer']['time_ms_median'] / pmb['exact_ms']:.2f} exact micro-batches;"
    )
    acc = result["accumulation"]
    parts.append(
        f"accumulating the factor over k={acc['k']} saves "
        f"{100 * acc['saved_fraction_of_all_microbatch']:.1f}% of an all-takeover micro-batch"
    )
    busy = (result["contention"] or {}).get("other_runnable_mean", 0.0)
    if result["config"]["device"] == "cpu" and busy >= CONTENDED:
        parts.append(
            f"WARNING: other processes kept {busy:.1f} threads runnable on average during "
            f"timing; min-based c(all)={m['all']['c_ratio_of_minimums']:.2f}"
        )
    return " ".join(parts)


def main(argv: Optional[List[str]] = None) -> None:
    """Parse flags, set up one process group and megatron, run, write JSON, print summary."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_cpu_warnings()
    # megatron-core's own import-time notices about optional fused kernels are noise here.
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    # A one-rank group on an in-memory store: no port to pick, no clash with other jobs.
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
    )
    runtime = CpuRuntime() if device.type == "cpu" else contextlib.nullcontext()
    try:
        with runtime:
            result = run(args)
    finally:
        dist.destroy_process_group()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result), flush=True)


if __name__ == "__main__":
    main()
