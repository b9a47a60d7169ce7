"""Worker for tests/integration/takeover/test_failure_training.py (and test_virtual_replicas.py):
the example trainer through failures.

Run under torchrun. ``--cases FILE`` holds a JSON list of cases, each with ``argv`` (the
trainer's flags) and ``dump_iteration``; one process group serves every case in turn (a case
builds its own parallel state and tears it down), which saves one start-up per case.

Per case and rank it writes ``<out>/<name>/rank<R>.pt`` with:

* ``grads``: the post-sync, pre-optimizer gradients at ``dump_iteration``, as
  ``{(key, layer_offset): [(global_shape, global_offset, local grad)]}`` pieces keyed like
  megatron-core's sharded state dict, so any TP/PP layout can be assembled into full tensors;
* ``digest``: sha256 of this rank's parameters and optimizer state after the last iteration;
* ``tokens``: a hash of every micro-batch's tokens this rank processed, per iteration.

``--reference`` (one rank) computes, for the same cases, each micro-batch's gradient alone in
its planned mode, and writes ``<out>/<name>/reference.pt`` with the per-micro-batch gradients
and the plan, from which the test applies the documented formula.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples", "pretrain_gpt"))


def keyed_pieces(chunks: List[torch.nn.Module], source: str) -> Dict[Tuple, List]:
    """This rank's ``source`` tensors (``main_grad`` or ``param``), keyed by global position."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    out: Dict[Tuple, List] = {}
    for chunk in chunks:
        owners = {}
        for p in chunk.parameters():
            owners[p.data_ptr()] = p
        sharded = chunk.sharded_state_dict(prefix="")
        apply_factories(sharded)
        for sh in nested_values(sharded):
            if not isinstance(sh, ShardedTensor) or not sh.key.endswith(("weight", "bias")):
                continue
            data = sh.data
            param = _owner(owners, data)
            base = param.main_grad if source == "main_grad" else param.detach()
            offset = (data.data_ptr() - param.data_ptr()) // data.element_size()
            local = base.as_strided(data.shape, data.stride(), base.storage_offset() + offset)
            n = sh.prepend_axis_num
            key = (sh.key, tuple(sh.global_offset[:n]))
            out.setdefault(key, []).append(
                (tuple(sh.global_shape[n:]), tuple(sh.global_offset[n:]), local.clone())
            )
    return out


def _owner(owners: Dict[int, torch.nn.Parameter], data: torch.Tensor) -> torch.nn.Parameter:
    for ptr, p in owners.items():
        end = ptr + p.numel() * p.element_size()
        if ptr <= data.data_ptr() < end:
            return p
    raise KeyError("sharded tensor is not a view of a parameter")


def state_digest(trainer: Any) -> str:
    """sha256 over this rank's parameters and its optimizer's state tensors."""
    digest = hashlib.sha256()
    for chunk in trainer.model_chunks:
        for name, p in sorted(chunk.named_parameters()):
            digest.update(name.encode())
            digest.update(p.detach().contiguous().view(torch.uint8).numpy())
    opt = trainer.optimizer
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(sub, "optimizer", sub)
        for group in inner.param_groups:
            for p in group["params"]:
                for k, v in sorted(inner.state.get(p, {}).items()):
                    if torch.is_tensor(v):
                        digest.update(k.encode())
                        digest.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def _token_hash(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.contiguous().numpy().tobytes()).hexdigest()[:16]


def run_case(case: Dict[str, Any], out: str) -> None:
    import pretrain_gpt
    from arguments import parse_args
    from megatron.core import parallel_state as ps

    args = parse_args(case["argv"])
    trainer = pretrain_gpt.Trainer(args, torch.device("cpu"))
    rank = dist.get_rank()
    result: Dict[str, Any] = {"tokens": {}, "records": []}
    step = trainer.optimizer.step

    def dumping_step() -> Any:
        if trainer.iteration + 1 == case.get("dump_iteration"):
            result["grads"] = keyed_pieces(trainer.model_chunks, "main_grad")
        return step()

    trainer.optimizer.step = dumping_step
    forward_step = trainer._forward_step

    def recording_forward_step(data_iterator: Any, model: Any) -> Any:
        batch = next(data_iterator)
        it = trainer.iteration + 1
        result["tokens"].setdefault(it, []).append(_token_hash(batch["tokens"]))
        return forward_step(iter([batch]), model)

    trainer._forward_step = recording_forward_step
    if args.mecefo:  # the wrapped schedule captured the bound method: rebuild it
        trainer.forward_backward = trainer._forward_backward_func()
    while trainer.iteration < args.train_iters:
        result["records"].append(trainer.train_step())
    result["digest"] = state_digest(trainer)
    result["params"] = keyed_pieces(trainer.model_chunks, "param")
    result["dp_rank"] = ps.get_data_parallel_rank()
    result["tp_rank"] = ps.get_tensor_model_parallel_rank()
    result["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    if case.get("tokens_only_first_tp", True) and ps.get_tensor_model_parallel_rank() != 0:
        result["tokens"] = {}
    if not ps.is_pipeline_first_stage(ignore_virtual=True):
        result["tokens"] = {}  # the first stage's count is the replica's micro-batch count
    os.makedirs(os.path.join(out, case["name"]), exist_ok=True)
    torch.save(result, os.path.join(out, case["name"], f"rank{rank}.pt"))
    ps.destroy_model_parallel()


def reference_case(case: Dict[str, Any], out: str) -> None:
    """Each micro-batch of the global batch alone, on one rank, in both modes.

    Writes the gradient of every micro-batch of iteration ``dump_iteration`` (exact and
    takeover) and the token hash of every micro-batch of iterations ``1..train_iters``.
    """
    import pretrain_gpt
    from arguments import parse_args
    from megatron.core import parallel_state as ps

    from megatron_mecefo.takeover.data_remap import GlobalBatchLayout

    args = parse_args(case["argv"])  # one rank, MeCeFO modules, no failures
    trainer = pretrain_gpt.Trainer(args, torch.device("cpu"))
    layout = GlobalBatchLayout(args.global_batch_size, args.micro_batch_size, 1)
    iteration = case["dump_iteration"]
    state = trainer.controller.state
    chunk, ddp = trainer.model_chunks[0], trainer.model[0]
    grads: Dict[Tuple[int, ...], Dict[str, Any]] = {}
    consumed = (iteration - 1) * args.global_batch_size
    for k in range(layout.microbatches):
        samples = tuple(layout.samples(consumed, 0, k))
        for mode in ("exact", "takeover"):
            ddp.zero_grad_buffer()
            batch = trainer._fetch(list(samples))
            state.start_step(iteration, [mode])
            state.begin_microbatch(chunk)
            losses = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            mask = batch["loss_mask"].float()
            ((losses.float() * mask).sum() / mask.sum()).backward()
            grads.setdefault(samples, {})[mode] = keyed_pieces(trainer.model_chunks, "main_grad")
    tokens = {}
    for it in range(1, args.train_iters + 1):
        consumed = (it - 1) * args.global_batch_size
        tokens[it] = {
            tuple(layout.samples(consumed, 0, k)): _token_hash(
                trainer._fetch(layout.samples(consumed, 0, k))["tokens"]
            )
            for k in range(layout.microbatches)
        }
    os.makedirs(os.path.join(out, case["name"]), exist_ok=True)
    torch.save({"grads": grads, "tokens": tokens}, os.path.join(out, case["name"], "reference.pt"))
    ps.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", action="store_true")
    a = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron_mecefo.runtime import enable_cpu_runtime, quiet_cpu_warnings

    quiet_cpu_warnings()
    enable_cpu_runtime()
    with open(a.cases) as f:
        cases = json.load(f)
    for case in cases:
        if a.reference:
            reference_case(case, a.out)
        else:
            run_case(case, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
