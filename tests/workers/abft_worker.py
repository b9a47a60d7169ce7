"""One gloo rank of the attention-ABFT tests: real megatron-core modules on CPU.

Usage: ``torchrun --nproc-per-node N tests/workers/abft_worker.py OUT_DIR LAYOUT SCENARIO...``.
LAYOUT is ``tp1``, ``tp2`` or ``tp2sp``. Each scenario measures numbers (max differences to a
fault-free run, reported kinds and indices, actions) that rank 0 writes to
``OUT_DIR/<LAYOUT>.json``; ``test_abft.py`` asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

SEQ, MBS, VOCAB = 32, 2, 64
OPS = ("qkv", "scores", "context", "proj")
KINDS = ("inf", "nan", "near_inf", "bitflip")


def make_config(layout: str, **overrides: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, add_bias_linear=True, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=2 if layout.startswith("tp2") else 1,
        sequence_parallel=layout == "tp2sp",
    )  # fmt: skip
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build(config, abft: bool, mecefo: bool = False):
    from megatron.core.models.gpt import GPTModel

    from megatron_mecefo.abft import abft_spec
    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec
    from megatron_mecefo.gpt.layout_invariant_init import layout_invariant_init_
    from megatron_mecefo.techniques.specs import mecefo_spec

    spec = gpt_decoder_spec(config, "local")
    if mecefo:
        spec = mecefo_spec(spec)
    if abft:
        spec = abft_spec(spec)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope",
    )  # fmt: skip
    layout_invariant_init_([model], config, 7)
    return model


def tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)


def loss_and_grads(model, state=None, iteration: int = 1):
    """One forward+backward; returns (per-token losses, {name: grad}, step record)."""
    model.zero_grad(set_to_none=True)
    if state is not None:
        state.start_step(iteration)
        state.begin_microbatch(model)
    data = tokens()
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    losses = model(data[:, :-1], pos, None, labels=data[:, 1:]).float()
    losses.mean().backward()
    record = state.end_step() if state is not None else None
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, record


def all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def diffs(ref, got) -> Dict[str, float]:
    loss = (ref[0] - got[0]).abs().max().item()
    grad = max((ref[1][n] - got[1][n]).abs().max().item() for n in ref[1])
    return {"loss": all_max(loss), "grad": all_max(grad)}


def state_for(**cfg: Any):
    from megatron_mecefo.abft import AbftConfig, AbftState

    return AbftState(AbftConfig(**cfg), dist.get_rank())


def bound(model, state):
    from megatron_mecefo.abft import apply_abft

    apply_abft(model, state)
    return state


def _events(state) -> List[Dict[str, Any]]:
    return [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in e.items()}
        for e in state.counters.events
    ]


# --------------------------------------------------------------------------------------------
def scenario_identity(layout: str) -> dict:
    """No fault: ABFT on is bit-identical to the stock spec (loss and every gradient)."""
    config = make_config(layout)
    ref = loss_and_grads(build(config, False))
    model = build(config, True)
    state = bound(model, state_for())
    out = {"full": diffs(ref, loss_and_grads(model, state))}
    out["full"]["checks"] = state.counters.checks
    out["full"]["detections"] = state.counters.step_global and dict(state.counters.totals())
    bound(model, state_for(mode="detect"))
    out["detect"] = diffs(
        ref, loss_and_grads(model, model.decoder.layers[0].self_attention.core_attention.abft_state)
    )
    return out


def scenario_kinds(layout: str, ops=OPS, kinds=KINDS, rank: int = 0) -> dict:
    """One fault per (op, kind): detected, located, corrected; output equals fault-free."""
    config = make_config(layout)
    model = build(config, True)
    ref = loss_and_grads(model, bound(model, state_for()))
    result = {}
    for op in ops:
        for kind in kinds:
            state = bound(model, state_for(inject=(f"kind={kind},op={op},layer=2,iter=1,"
                                                   f"rank={rank}",)))  # fmt: skip
            got = loss_and_grads(model, state)
            result[f"{op}/{kind}"] = {**diffs(ref, got), "record": got[2], "events": _events(state)}
    return result


def scenario_patterns(layout: str) -> dict:
    """Two faults in one line, in one row, and a 2x2 block, for every op."""
    config = make_config(layout)
    model = build(config, True)
    ref = loss_and_grads(model, bound(model, state_for()))
    result = {}
    for op in OPS:
        for pattern in ("line", "row", "block"):
            spec = f"kind=inf,op={op},layer=1,iter=1,pattern={pattern}"
            state = bound(model, state_for(inject=(spec,)))
            got = loss_and_grads(model, state)
            result[f"{op}/{pattern}"] = {**diffs(ref, got), "record": got[2]}
    return result


def scenario_modes(layout: str) -> dict:
    """Detection-only mode recomputes; without recompute the step is poisoned or raises."""
    from megatron_mecefo.abft import AbftUncorrectableError

    config = make_config(layout)
    model = build(config, True)
    ref = loss_and_grads(model, bound(model, state_for()))
    out = {}
    state = bound(model, state_for(mode="detect", inject=("kind=nan,op=scores,layer=1,iter=1",)))
    got = loss_and_grads(model, state)
    out["detect"] = {**diffs(ref, got), "record": got[2]}
    state = bound(model, state_for(recompute=False, inject=("kind=inf,op=proj,layer=1,iter=1,"
                                                            "pattern=line",)))  # fmt: skip
    got = loss_and_grads(model, state)
    out["skip"] = {"record": got[2], "loss_finite": bool(torch.isfinite(got[0]).all())}
    state = bound(
        model,
        state_for(
            recompute=False,
            on_uncorrectable="raise",
            inject=("kind=inf,op=proj,layer=1,iter=1,pattern=line",),
        ),
    )
    try:
        loss_and_grads(model, state)
        out["raise"] = ""
    except AbftUncorrectableError as err:
        out["raise"] = str(err)
    # every:2 checks even iterations only; the injector still fires on odd ones.
    state = bound(model, state_for(policy="every:2", inject=("kind=nan,op=qkv,layer=1,every=1",)))
    out["every2"] = [
        {"protected": r["protected"], "corrected": r["corrected"], "finite": f}
        for r, f in (
            (rec, bool(torch.isfinite(loss).all()))
            for loss, _, rec in (loss_and_grads(model, state, i) for i in (1, 2))
        )
    ]
    return out


def scenario_takeover(layout: str) -> dict:
    """MeCeFO takeover mode (no attention backward): the forward is still protected."""
    from megatron_mecefo.techniques.apply import apply_mecefo
    from megatron_mecefo.techniques.config import MecefoConfig
    from megatron_mecefo.techniques.state import MecefoState

    config = make_config(layout)
    model = build(config, True, mecefo=True)
    mecefo = MecefoState(MecefoConfig(rank=8))
    apply_mecefo(model, mecefo)
    out = {}
    for tag, spec in (("clean", None), ("fault", "kind=inf,op=context,layer=1,iter=1")):
        state = bound(model, state_for(inject=(spec,) if spec else ()))
        mecefo.start_step(0, ["takeover"])
        mecefo.begin_microbatch(model)
        out[tag] = loss_and_grads(model, state)
    out = {**diffs(out["clean"], out["fault"]), "record": out["fault"][2]}
    return out


def scenario_spec_errors(layout: str) -> dict:
    """Unsupported modules are refused by name; the TE classes by their names (stand-ins)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_mecefo.abft.spec import AbftSpecError, abft_spec

    def te_standin(name: str) -> type:
        return type(name, (torch.nn.Module,), {})

    out = {}
    for field, name in (
        ("core_attention", "TEDotProductAttention"),
        ("linear_qkv", "TELayerNormColumnParallelLinear"),
        ("linear_proj", "RowParallelLinearOfSomeoneElse"),
    ):
        spec = gpt_layer_specs.get_gpt_layer_local_spec()
        setattr(spec.submodules.self_attention.submodules, field, te_standin(name))
        try:
            abft_spec(spec)
            out[field] = ""
        except AbftSpecError as err:
            out[field] = str(err)
    return out


SCENARIOS: Dict[str, Callable[[str], dict]] = {
    "identity": scenario_identity,
    "kinds": scenario_kinds,
    "kinds_rank1": lambda layout: scenario_kinds(layout, kinds=("inf", "bitflip"), rank=1),
    "patterns": scenario_patterns,
    "modes": scenario_modes,
    "takeover": scenario_takeover,
    "spec_errors": scenario_spec_errors,
}


def main() -> None:
    out_dir, layout, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_mecefo.runtime import enable_cpu_runtime, quiet_cpu_warnings

    quiet_cpu_warnings()
    enable_cpu_runtime()
    ps.initialize_model_parallel(tensor_model_parallel_size=2 if layout.startswith("tp2") else 1)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    results: Dict[str, Any] = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](layout)
        except Exception:  # reported to pytest, which fails with the traceback
            results[name] = {"error": traceback.format_exc()}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"{layout}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
