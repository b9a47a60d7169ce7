"""One gloo rank of the MeCeFO technique tests: real megatron-core modules on CPU.

Usage:
``torchrun --nproc-per-node N tests/workers/techniques_worker.py OUT_DIR LAYOUT SCENARIO...``.
LAYOUT is ``tp1``, ``tp2``, ``tp2sp`` (tensor parallel, optionally sequence parallel) or
``tp2dp2``. Each scenario measures numbers (max differences, byte counts, refresh steps) that
rank 0 writes to ``OUT_DIR/<LAYOUT>.json``; the pytest side asserts on them. Tensors that other
layouts compare against go to ``OUT_DIR/<LAYOUT>_<name>.pt``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

SEQ, MBS, VOCAB = 16, 2, 64
MHA_NAMES = ("input_layernorm", "self_attention")
FFN_WEIGHTS = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


def tp_size(layout: str) -> int:
    return 2 if layout.startswith("tp2") else 1


def make_config(layout: str, **overrides: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, add_bias_linear=True, hidden_dropout=0.1,
        attention_dropout=0.1, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp_size(layout), sequence_parallel=layout == "tp2sp",
    )  # fmt: skip
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build(config, mecefo: bool, seed: int = 7):
    from megatron.core.models.gpt import GPTModel

    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec
    from megatron_mecefo.gpt.layout_invariant_init import layout_invariant_init_
    from megatron_mecefo.techniques.specs import mecefo_spec

    spec = gpt_decoder_spec(config, "local")
    if mecefo:
        spec = mecefo_spec(spec)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope",
    )  # fmt: skip
    layout_invariant_init_([model], config, seed)
    return model


def batches(n: int, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen) for _ in range(n)]


def reseed(seed: int = 11) -> None:
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def microbatch_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    return model(inp, pos, None, labels=labels).float().mean()


def run_step(model, data, state=None, modes=None, step=0) -> List[float]:
    """Forward+backward of each micro-batch (loss / n); returns the losses."""
    if state is not None:
        state.start_step(step, modes)
    reseed(100 + step)
    losses = []
    for tokens in data:
        if state is not None:
            state.begin_microbatch(model)
        loss = microbatch_loss(model, tokens)
        (loss / len(data)).backward()
        losses.append(loss.item())
    return losses


def grads(model) -> Dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()
    }


def is_mha(name: str) -> bool:
    return any(f".{m}." in name for m in MHA_NAMES)


def max_diff(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return (a - b).abs().max().item()


def all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def state_for(**cfg: Any):
    from megatron_mecefo.techniques.config import MecefoConfig
    from megatron_mecefo.techniques.state import MecefoState

    return MecefoState(MecefoConfig(**cfg))


# --------------------------------------------------------------------------------------------
def scenario_exact(layout: str, out: str) -> dict:
    """Every micro-batch exact: the MeCeFO model is bit-identical to the stock local spec."""
    from megatron_mecefo.techniques.apply import apply_mecefo

    config = make_config(layout)
    data = batches(2)
    stock, mec = build(config, False), build(config, True)
    state = state_for()
    apply_mecefo(mec, state)
    loss_stock = run_step(stock, data)
    loss_mec = run_step(mec, data, state, ["exact", "exact"])
    g_stock, g_mec = grads(stock), grads(mec)
    return {
        "loss_max_diff": all_max(
            max(abs(a - b) for a, b in zip(loss_stock, loss_mec, strict=True))
        ),
        "grad_max_diff": all_max(max(max_diff(g_stock[n], g_mec[n]) for n in g_stock)),
        "num_params": len(g_stock),
        "same_names": list(g_stock) == list(g_mec),
    }


def _detached_attention_reference(config, data) -> tuple:
    """Stock model; the attention branch output detached with a plain PyTorch forward hook."""
    ref = build(config, False)
    for layer in ref.decoder.layers:
        layer.self_attention.register_forward_hook(
            lambda m, i, o: (o[0].detach(), None if o[1] is None else o[1].detach())
        )
    return run_step(ref, data), grads(ref)


def scenario_takeover(layout: str, out: str) -> dict:
    """Takeover micro-batches against the exact loss and a detached-attention reference."""
    from megatron_mecefo.techniques.apply import apply_mecefo, mha_group_parameters

    config = make_config(layout)
    data = batches(2)
    exact_losses = run_step(build(config, False), data)
    ref_losses, ref_grads = _detached_attention_reference(config, data)
    result: Dict[str, Any] = {"ref_loss_max_diff": all_max(
        max(abs(a - b) for a, b in zip(exact_losses, ref_losses, strict=True)))}  # fmt: skip
    for tag, cfg in {
        "skip_recompute": dict(lowrank_ffn=False),
        "skip_only": dict(recompute_ffn=False, lowrank_ffn=False),
        "all": dict(rank=16),
    }.items():
        mec = build(config, True)
        state = state_for(**cfg)
        apply_mecefo(mec, state)
        mha_ids = {id(p) for p in mha_group_parameters(mec)}
        losses = run_step(mec, data, state, ["takeover", "takeover"])
        g = grads(mec)
        named = dict(mec.named_parameters())
        mha = [n for n in g if id(named[n]) in mha_ids]
        others = [n for n in g if id(named[n]) not in mha_ids]
        not_ffn_w = [n for n in others if not n.endswith(FFN_WEIGHTS)]
        result[tag] = {
            "loss_max_diff": all_max(
                max(abs(a - b) for a, b in zip(exact_losses, losses, strict=True))
            ),
            "mha_names": sorted(mha),
            "mha_all_zero": all(g[n] is not None and not g[n].any() for n in mha),
            "others_max_diff": all_max(max(max_diff(g[n], ref_grads[n]) for n in others)),
            "others_not_ffn_weight_max_diff": all_max(
                max(max_diff(g[n], ref_grads[n]) for n in not_ffn_w)
            ),
            "ffn_weight_max_diff": all_max(
                max(max_diff(g[n], ref_grads[n]) for n in others if n.endswith(FFN_WEIGHTS))
            ),
        }
    return result


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    group, size = _tp()
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def scenario_mixed(layout: str, out: str) -> dict:
    """In a step mixing modes, each micro-batch contributes what it would alone."""
    from megatron_mecefo.techniques.apply import apply_mecefo

    config = make_config(layout, hidden_dropout=0.0, attention_dropout=0.0)
    d0, d1 = batches(2)
    mixed, alone = build(config, True), build(config, True)
    state, state_alone = state_for(rank=8), state_for(rank=8)
    apply_mecefo(mixed, state)
    apply_mecefo(alone, state_alone)
    run_step(mixed, [d0, d1], state, ["exact", "takeover"])
    run_step(alone, [d0], state_alone, ["exact"])
    g_exact = grads(alone)
    alone.zero_grad()
    run_step(alone, [d1], state_alone, ["takeover"], step=1)
    g_takeover, g_mixed = grads(alone), grads(mixed)
    return {
        "max_diff": all_max(
            max(max_diff(g_mixed[n], (g_exact[n] + g_takeover[n]) / 2) for n in g_mixed)
        )
    }


def _capture_linear_io(model) -> Dict[str, Dict[str, list]]:
    """Record each FFN linear's input X and output gradient G, full sequence, [tokens, dim]."""
    io: Dict[str, Dict[str, list]] = {}
    for name, module in model.named_modules():
        if not name.endswith(("linear_fc1", "linear_fc2")):
            continue
        rec = io.setdefault(name, {"x": [], "g": []})
        fc1 = name.endswith("linear_fc1")

        def hook(mod, inputs, output, rec=rec, fc1=fc1):
            sp = mod.sequence_parallel
            x = inputs[0].detach()
            x = _gather(x, 0) if (fc1 and sp) else x  # fc1 gathers the sequence itself
            rec["x"].append(x.reshape(-1, x.shape[-1]))

            def grad_hook(g, rec=rec):
                g = _gather(g, 0) if (sp and not fc1) else g  # fc2 reduce-scatters its output
                rec["g"].append(g.reshape(-1, g.shape[-1]))

            output[0].register_hook(grad_hook)

        module.register_forward_hook(hook)
    return io


def _full_tensor(local: torch.Tensor, fc1: bool) -> torch.Tensor:
    """An FFN weight (or its grad) in TP1 layout; SwiGLU fc1 shards are [gate_k; up_k]."""
    if not fc1:
        return _gather(local, 1)
    gate, up = local.chunk(2, 0)
    return torch.cat([_gather(gate, 0), _gather(up, 0)], 0)


def scenario_lowrank(layout: str, out: str) -> dict:
    """Low-rank FFN weight gradients against the formula, the exact gradient, and TP1."""
    from megatron.core import parallel_state as ps

    from megatron_mecefo.techniques.apply import apply_mecefo

    config = make_config(layout, hidden_dropout=0.0, attention_dropout=0.0)
    data = batches(2)
    stock = build(config, False)
    io = _capture_linear_io(stock)
    run_step(stock, data)
    exact = grads(stock)
    tp_rank = ps.get_tensor_model_parallel_rank()
    result: Dict[str, Any] = {}
    for rank in (64, 8):  # 64 = full rank of every FFN weight of this model; 8 < full
        mec = build(config, True)
        state = state_for(rank=rank, skip_attention=False, recompute_ffn=False)
        apply_mecefo(mec, state)
        run_step(mec, data, state, ["takeover", "takeover"])
        g = grads(mec)
        named = dict(mec.named_parameters())
        formula, vs_exact, rest, full = 0.0, 0.0, 0.0, {}
        for n, grad in g.items():
            if not n.endswith(FFN_WEIGHTS):
                rest = max(rest, max_diff(grad, exact[n]))
                continue
            fc1 = n.endswith("linear_fc1.weight")
            rec = io[n.rsplit(".", 1)[0]]
            # Independent reference in float64: V from an SVD of the gathered full weight.
            w_full = _full_tensor(named[n].detach(), fc1).double()
            v = torch.linalg.svd(w_full, full_matrices=False).Vh[:rank].T
            x = torch.cat(rec["x"]).double()
            g_out = torch.cat(rec["g"]).double()
            if fc1:
                reference = g_out.T @ (x @ v) @ v.T
            else:
                rows = slice(tp_rank * x.shape[1], (tp_rank + 1) * x.shape[1])
                reference = g_out.T @ (_gather(x, 1) @ v) @ v[rows].T
            formula = max(formula, ((grad.double() - reference).norm() / reference.norm()).item())
            vs_exact = max(vs_exact, ((grad - exact[n]).norm() / exact[n].norm()).item())
            full[n] = _full_tensor(grad, fc1)
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(out, f"{layout}_lowrank_r{rank}.pt"))
        result[f"r{rank}"] = {
            "formula_rel_err": all_max(formula),
            "rel_err_vs_exact": all_max(vs_exact),
            "other_grads_max_diff": all_max(rest),
        }
    return result


def scenario_refresh(layout: str, out: str) -> dict:
    """V is recomputed on first use and every τ steps, from the current weights."""
    from megatron_mecefo.techniques.apply import apply_mecefo

    config = make_config(layout)
    mec = build(config, True)
    state = state_for(rank=8, basis_interval=3)
    apply_mecefo(mec, state)
    opt = torch.optim.SGD(mec.parameters(), lr=0.5)
    fc1 = mec.decoder.layers[0].mlp.linear_fc1
    plan = {0: "takeover", 1: "takeover", 2: "exact", 3: "exact", 4: "takeover", 5: "takeover",
            6: "takeover", 7: "takeover"}  # fmt: skip
    bases, changed = {}, {}
    for step, mode in plan.items():
        before = fc1.mecefo_basis
        run_step(mec, batches(1, seed=step), state, [mode], step=step)
        opt.step()
        opt.zero_grad()
        bases[step] = fc1.mecefo_basis
        changed[step] = before is not None and fc1.mecefo_basis is not before
    names = sorted({n for _, n in state.basis_refreshes})
    return {
        "refresh_steps": sorted({s for s, _ in state.basis_refreshes}),
        "refresh_names": names,
        "per_step_count": {s: sum(1 for t, _ in state.basis_refreshes if t == s)
                           for s in sorted({s for s, _ in state.basis_refreshes})},  # fmt: skip
        "new_basis_object_at": [s for s, c in changed.items() if c],
        "basis_changed_value": bool((bases[4] - bases[1]).abs().max() > 0),
    }


def scenario_memory(layout: str, out: str) -> dict:
    """Bytes saved for backward inside the decoder, per micro-batch, exact vs takeover."""
    from megatron_mecefo.techniques.apply import apply_mecefo

    config = make_config(layout)
    result: Dict[str, Any] = {}
    for tag, cfg, mode in [
        ("exact", {}, "exact"),
        ("skip", dict(recompute_ffn=False, lowrank_ffn=False), "takeover"),
        ("recompute", dict(skip_attention=False, lowrank_ffn=False), "takeover"),
        ("lowrank", dict(skip_attention=False, recompute_ffn=False, rank=8), "takeover"),
        ("takeover", dict(rank=8), "takeover"),
    ]:
        mec = build(config, True)
        state = state_for(**cfg)
        apply_mecefo(mec, state)
        result[tag] = saved_bytes_in_decoder(mec, state, mode)
    return result


def saved_bytes_in_decoder(model, state, mode: str) -> int:
    """Activation bytes autograd saves during the decoder's forward, for one micro-batch."""
    from megatron_mecefo.techniques.activation_bytes import SavedActivationBytes

    state.start_step(0, [mode])
    state.begin_microbatch(model)
    reseed()
    with SavedActivationBytes(model, scope=model.decoder) as saved:
        loss = microbatch_loss(model, batches(1)[0])
    loss.backward()
    return saved.nbytes


def _ddp_train(config, modes_per_step, overlap: bool, distopt: bool) -> Dict[str, torch.Tensor]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mecefo.techniques.apply import apply_mecefo

    config = dataclasses.replace(config)
    model = build(config, True)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, use_distributed_optimizer=distopt, bucket_size=2000
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distopt), [ddp]
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    if overlap:
        config.grad_sync_func = ddp.start_grad_sync
    state = state_for(rank=8)
    apply_mecefo(ddp, state)

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        out = chunk(tokens[:, :-1], torch.arange(SEQ).expand(MBS, SEQ), None, labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    for step, modes in enumerate(modes_per_step):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        state.start_step(step, modes)
        reseed(100 + step)
        data = batches(len(modes), seed=1000 * step + dist.get_rank())
        get_forward_backward_func()(
            forward_step_func=state.wrap_forward_step(forward_step), data_iterator=iter(data),
            model=[ddp], num_microbatches=len(modes), seq_length=SEQ, micro_batch_size=MBS,
            forward_only=False,
        )  # fmt: skip
        ok, _, _ = opt.step()
        assert ok
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def scenario_ddp(layout: str, out: str) -> dict:
    """Mixed exact/takeover steps under DDP: overlap and the distributed optimizer agree."""
    from megatron.core import parallel_state as ps

    config = make_config(layout)
    dp = ps.get_data_parallel_rank()
    # Step 0 is all exact (DDP records its golden hook counts there); DP ranks then differ.
    mixed = [["takeover", "exact", "takeover"], ["exact", "exact", "takeover"]][dp % 2]
    modes = [["exact"] * 3, mixed, ["takeover"] * 3]
    runs = {  # name: (overlap_grad_reduce, use_distributed_optimizer)
        name: _ddp_train(config, modes, overlap, distopt)
        for name, (overlap, distopt) in {
            "plain": (False, False), "overlap": (True, False),
            "distopt": (False, True), "distopt_overlap": (True, True),
        }.items()  # fmt: skip
    }
    all_exact = [["exact"] * 3] * 3
    stock = _ddp_train(config, all_exact, False, False)
    stock_distopt_overlap = _ddp_train(config, all_exact, True, True)
    stock_distopt = _ddp_train(config, all_exact, False, True)

    def diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
        return all_max(max(max_diff(a[n], b[n]) for n in a))

    return {
        "overlap_vs_plain": diff(runs["overlap"], runs["plain"]),
        "distopt_overlap_vs_distopt": diff(runs["distopt_overlap"], runs["distopt"]),
        "distopt_vs_plain": diff(runs["distopt"], runs["plain"]),
        "mixed_vs_all_exact": diff(runs["plain"], stock),
        # Megatron's own overlap-vs-not difference with the distributed optimizer, no MeCeFO.
        "stock_distopt_overlap_vs_distopt": diff(stock_distopt_overlap, stock_distopt),
    }


def scenario_checkpoint(layout: str, out: str) -> dict:
    """A MeCeFO model loads a stock checkpoint, and a stock model a MeCeFO one."""
    from megatron.core import dist_checkpointing

    config = make_config(layout)
    result: Dict[str, Any] = {}
    for src_mecefo in (False, True):
        src = build(config, src_mecefo, seed=3)
        dst = build(config, not src_mecefo, seed=4)
        with tempfile.TemporaryDirectory() as tmp:
            path = tmp if dist.get_world_size() == 1 else _shared_dir(tmp)
            dist_checkpointing.save(src.sharded_state_dict(), path)
            loaded = dist_checkpointing.load(dst.sharded_state_dict(), path)
            dst.load_state_dict(loaded, strict=False)
        a, b = dict(src.named_parameters()), dict(dst.named_parameters())
        tag = "mecefo_to_stock" if src_mecefo else "stock_to_mecefo"
        result[tag] = {
            "same_keys": sorted(src.sharded_state_dict()) == sorted(dst.sharded_state_dict()),
            "max_diff": all_max(max(max_diff(a[n], b[n]) for n in a)),
            "num_params": len(a),
        }
    return result


def _shared_dir(local: str) -> str:
    obj = [local]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def scenario_plan_check(layout: str, out: str) -> dict:
    """Differing plans in one TP group are caught on every rank, before any collective."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    state = state_for()
    state.start_step(0, ["exact", "takeover"])
    state.check_group_consistent(group)  # same plan: passes
    state.start_step(1, ["exact", "takeover"] if dist.get_rank() == 0 else ["takeover", "exact"])
    try:
        state.check_group_consistent(group)
        caught = False
    except RuntimeError:
        caught = True
    flag = torch.tensor([int(caught)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return {"caught_on_all_ranks": bool(flag.item())}


def scenario_build_errors(layout: str, out: str) -> dict:
    """Unsupported combinations fail when the model is built or bound, with the reason."""
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    from megatron_mecefo.techniques.apply import apply_mecefo
    from megatron_mecefo.techniques.specs import mecefo_spec

    def error_of(fn: Callable[[], Any]) -> str:
        try:
            fn()
        except (ValueError, RuntimeError) as err:
            return f"{type(err).__name__}: {err}"
        return ""

    def gpt(config, spec):
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                        max_sequence_length=SEQ)  # fmt: skip

    local = gpt_layer_specs.get_gpt_layer_local_spec()
    return {
        "recompute_layernorm": error_of(lambda: gpt(make_config(
            layout, recompute_granularity="selective", recompute_modules=["layernorm"]),
            mecefo_spec(local))),  # fmt: skip
        "fp32_residual": error_of(
            lambda: gpt(make_config(layout, fp32_residual_connection=True), mecefo_spec(local))
        ),
        "stock_model_bound": error_of(lambda: apply_mecefo(build(make_config(layout), False),
                                                           state_for())),  # fmt: skip
        "lowrank_without_lowrank_spec": error_of(lambda: apply_mecefo(
            gpt(make_config(layout), mecefo_spec(local, lowrank=False)), state_for())),  # fmt: skip
        "no_lowrank_config_ok": error_of(lambda: apply_mecefo(
            gpt(make_config(layout), mecefo_spec(local, lowrank=False)),
            state_for(lowrank_ffn=False))),  # fmt: skip
    }


SCENARIOS: Dict[str, Callable[[str, str], dict]] = {
    "exact": scenario_exact,
    "takeover": scenario_takeover,
    "mixed": scenario_mixed,
    "lowrank": scenario_lowrank,
    "refresh": scenario_refresh,
    "memory": scenario_memory,
    "ddp": scenario_ddp,
    "checkpoint": scenario_checkpoint,
    "plan_check": scenario_plan_check,
    "build_errors": scenario_build_errors,
}


def main() -> None:
    out, layout, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    from megatron_mecefo.runtime import CpuRuntime, quiet_cpu_warnings

    quiet_cpu_warnings()
    results: Dict[str, Any] = {}
    with CpuRuntime():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size(layout))
        for name in names:
            try:
                results[name] = SCENARIOS[name](layout, out)
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                results[name] = {"error": traceback.format_exc()}
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"{layout}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
