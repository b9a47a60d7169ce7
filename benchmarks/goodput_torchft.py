"""One torchft replica group (one CPU process) training the example trainer's GPTModel.

:mod:`benchmarks.goodput` starts four of these (DP4, one replica per process) beside a torchft
Lighthouse, and SIGKILLs them from outside. The model, data, loss, optimizer settings and
evaluation follow ``examples/pretrain_gpt/pretrain_gpt.py`` with the goodput benchmark's flags
(the same ``TransformerConfig``, ``GPTModel`` and layer spec from megatron-core and this
project, the same layout-invariant initialisation from ``--seed``, the same GPT datasets and
``PretrainingSampler`` shares, Adam with decoupled weight decay and gradient clipping at 1.0).
What torchft changes: each replica is a world of one process, the gradient average goes
through ``Manager.allreduce`` (fault-tolerant, over the replicas in the quorum, divided by
their number) on one flat gradient buffer, the step commits only if
``Manager.should_commit()``, and a replacement heals from a peer's ``state_dict`` over HTTP.
``torchft.ddp.DistributedDataParallel`` (torch DDP whose comm hook calls the same
``Manager.allreduce`` per bucket) was tried first: when a peer died during the all-reduce,
every survivor crashed in its comm hook (``assert fut._fut``, ``torchft/ddp.py`` line 76 in
0.2.0: the hook expects a managed future, and after the error ``allreduce`` hands back a
plain one), so the survivors died with the victim. A replica that is not in a step's quorum
does not train on its share of that global batch: torchft drops it.

The optimizer is megatron-core's on CPU: ``torch.optim.AdamW`` with the same settings and the
same parameter groups (no weight decay on biases and 1-D parameters). Differences from the
example trainer, forced: no Megatron DDP (the gradients are averaged on one flat buffer
through torchft), no LR scheduler object (the benchmark's schedule is constant), and the
quorum is synchronous (``use_async_quorum=False``) so that the step number, and with it the
data share, is known before the forward pass. ``--device-clock SHAPE`` pads forward, backward
(per micro-batch) and the optimizer phase (all-reduce, clipping, step) as the example trainer's
device clock does.

``--min-replica-size``: the Manager's ``min_replica_size``, 4 in the benchmark's failure-free run
(every step with all replicas), 1 under kills.

Writes one JSON line per step attempt to ``--metrics-file``: the step, whether it committed,
the quorum's participants, whether this replica took part, and the time; at the end one
``eval`` line (validation loss and perplexity on the first ``--eval-iters`` global batches).

Run only under ``.venv-tft`` (``make bench-goodput`` sets it up; docs/results.md, Goodput).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List


def _parse(argv: List[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--lighthouse", required=True, help="the Lighthouse's address (http://...)")
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=256)
    p.add_argument("--split", default="90,10,0")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--data-path", required=True)
    p.add_argument("--metrics-file", required=True)
    p.add_argument("--wait-go", default=None, help="touch PATH.ready<id>, wait for PATH")
    p.add_argument("--timeout", type=float, default=30.0, help="torchft op timeout, seconds")
    p.add_argument("--min-replica-size", type=int, default=1,
                   help="the Manager's min_replica_size: 1 under kills (go on with fewer); the "
                   "failure-free run passes 4 (every step with all replicas)")  # fmt: skip
    p.add_argument("--device-clock", default=None, help="emulated GPU shape (device_clock.py)")
    return p.parse_args(argv)


def _loss(model: Any, batch: Dict[str, Any]) -> Any:
    """Megatron-LM's GPT loss of one micro-batch: mean over the unmasked tokens."""
    import torch

    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].view(-1).float()
    return torch.sum(out.float().view(-1) * mask) / mask.sum()


def main(argv: List[str] | None = None) -> None:
    """Train one replica group until the quorum's step reaches ``--train-iters``."""
    a = _parse(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from megatron_mecefo.data import (
        ByteTokenizer,
        PretrainingSampler,
        build_data_iterator,
        build_gpt_datasets,
    )
    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec
    from megatron_mecefo.gpt.layout_invariant_init import layout_invariant_init_
    from megatron_mecefo.runtime import enable_cpu_runtime, quiet_cpu_warnings

    quiet_cpu_warnings()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # Megatron's parallel state wants a torch world: this replica group is a world of one.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    enable_cpu_runtime()
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    torch.manual_seed(a.seed)
    tokenizer = ByteTokenizer()
    ffn = max(64, int((4 * a.hidden_size * 2 / 3) / 64) * 64)  # the example's SwiGLU size
    cfg = TransformerConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=a.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        init_method_std=0.02,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    vocab = math.ceil(tokenizer.vocab_size / a.make_vocab_size_divisible_by)
    vocab *= a.make_vocab_size_divisible_by
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=gpt_decoder_spec(cfg, "local", None),
        vocab_size=vocab,
        max_sequence_length=a.seq_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=10000,
    )
    layout_invariant_init_([model], cfg, a.seed)
    # megatron-core's parameter groups: no weight decay on biases and 1-D parameters (norms).
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    inner = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=a.weight_decay,
    )
    clock = None
    if a.device_clock:  # the example trainer's emulated phases (forward, backward, optimizer)
        from megatron_mecefo.planner.device_clock import clock_for

        clock = clock_for(a.device_clock, a.metrics_file.removesuffix(".jsonl") + ".clock")

    def state_dict() -> Dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: Dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    train_ds, valid_ds, _ = build_gpt_datasets(
        data_path=[a.data_path],
        mock=False,
        seq_length=a.seq_length,
        seed=a.seed,
        split=a.split,
        num_samples=(a.train_iters * a.global_batch_size, a.eval_iters * a.global_batch_size, 0),
        tokenizer=tokenizer,
        cache_dir=os.path.join(os.path.dirname(os.path.abspath(a.data_path)), "cache"),
    )
    if a.wait_go:  # the first four start together (a replacement joins a running job)
        Path(a.wait_go + f".ready{a.replica_id}").touch()
        while not Path(a.wait_go).exists():
            time.sleep(0.05)
    # This group's store lives in this process (a group of one), so no launcher holds it.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=a.min_replica_size,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        replica_id=f"replica{a.replica_id}",
    )
    optimizer = OptimizerWrapper(manager, inner)
    params = [p for p in model.parameters() if p.requires_grad]

    n_micro = a.global_batch_size // (a.micro_batch_size * a.replicas)

    def share(step: int) -> Iterator[Dict[str, Any]]:
        # This replica's micro-batches of global batch ``step``: the example trainer's share.
        sampler = PretrainingSampler(
            total_samples=len(train_ds),
            consumed_samples=step * a.global_batch_size,
            micro_batch_size=a.micro_batch_size,
            data_parallel_rank=a.replica_id,
            data_parallel_size=a.replicas,
        )
        return build_data_iterator(train_ds, sampler)

    out = open(a.metrics_file, "a", buffering=1)
    out.write(json.dumps({"type": "start", "replica": a.replica_id, "t": time.time()}) + "\n")
    while True:
        t0 = time.time()
        optimizer.zero_grad()  # the quorum; a replacement heals from a peer here
        step = manager.current_step()
        if step >= a.train_iters:
            break
        it = share(step)
        loss_sum = 0.0
        if clock is not None:  # after the quorum (recovery stays real): the step's phases
            clock.begin_step()
        for _ in range(n_micro):
            t_fwd = time.perf_counter()
            loss = _loss(model, next(it)) / n_micro
            if clock is not None:
                clock.pad("forward", t_fwd)
            t_bwd = time.perf_counter()
            loss.backward()
            loss_sum += float(loss)
            if clock is not None:
                clock.pad("backward", t_bwd)
        t_opt = time.perf_counter()
        # The fault-tolerant average over the quorum's replicas (a replica that is healing
        # sends zeros; an error makes should_commit() False), on one flat buffer.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
        participating = manager.is_participating()
        participants = manager.num_participants()
        committed = manager.should_commit()
        if committed:
            inner.step()
        if clock is not None:
            clock.pad("optimizer", t_opt)
            clock.end_step()
        rec = {
            "type": "train",
            "replica": a.replica_id,
            "step": step,
            "committed": committed,
            "participants": participants,
            "participating": participating,
            "loss": loss_sum,
            "t": time.time(),
            "step_time_s": time.time() - t0,
        }
        out.write(json.dumps(rec) + "\n")
    model.eval()
    with torch.no_grad():
        sampler = PretrainingSampler(
            total_samples=len(valid_ds),
            consumed_samples=0,
            micro_batch_size=a.micro_batch_size,
            data_parallel_rank=0,
            data_parallel_size=1,
        )
        it = build_data_iterator(valid_ds, sampler)
        total, tokens = 0.0, 0.0
        for _ in range(a.eval_iters * a.global_batch_size // a.micro_batch_size):
            b = next(it)
            o = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            m = b["loss_mask"].view(-1).float()
            total += float(torch.sum(o.float().view(-1) * m))
            tokens += float(m.sum())
    val = total / tokens
    out.write(
        json.dumps(
            {
                "type": "eval",
                "replica": a.replica_id,
                "step": step,
                "loss": val,
                "ppl": math.exp(min(val, 50.0)),
                "t": time.time(),
            }
        )
        + "\n"
    )
    out.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads and HTTP server would keep the process alive


if __name__ == "__main__":
    main()
