"""One gloo rank: a real megatron-core GPT + DDP trains a step, its gradient buffer is kept
(``take_grad_buffers``) and the model is rebuilt in a new parallel state on it
(``GradBufferReuse``), carrying the weights; a twin is rebuilt fresh from the same weights.

Prints one JSON line: whether the rebuilt DDP took the old buffer's memory, zeroed, with every
``main_grad`` inside it, and whether one more step gives the twin's gradients and weights.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def build(vocab: int = 64) -> tuple:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec

    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1, force_reset_rng=True)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=2, use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )  # fmt: skip
    gpt = GPTModel(config=cfg, transformer_layer_spec=gpt_decoder_spec(cfg), vocab_size=vocab,
                   max_sequence_length=16, position_embedding_type="rope")  # fmt: skip
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0), [model])
    cfg.finalize_model_grads_func = finalize_model_grads
    return gpt, model, opt


def step(model: object, opt: object, seed: int) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))

    def fwd(_it: object, m: object) -> tuple:
        out = m(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
        return out, lambda o: (o.sum(), torch.tensor(o.numel()), {"l": o.sum().detach()})

    model.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([None]), model=model,
                                num_microbatches=1, seq_length=16, micro_batch_size=2)  # fmt: skip
    opt.step()


def main() -> None:
    from megatron.core import parallel_state as ps

    from megatron_mecefo.recovery.abort import release_megatron
    from megatron_mecefo.recovery.state.grad_buffers import GradBufferReuse, take_grad_buffers
    from megatron_mecefo.runtime import CpuRuntime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    runtime = CpuRuntime().enable()
    gpt, model, opt = build()
    step(model, opt, 0)
    weights = {k: v.clone() for k, v in gpt.state_dict().items() if v is not None}
    kept = take_grad_buffers([model])
    assert len(kept) == 1
    ptr, numel = kept[0].data_ptr(), kept[0].numel()
    kept[0].fill_(7.0)  # stale gradients: the new buffer must start at zero
    release_megatron([gpt], [model], gpt.config)
    del gpt, model, opt
    ps.destroy_model_parallel()

    with GradBufferReuse(kept) as reuse:
        gpt, model, opt = build()
    buf = model.buffers[0].grad_data
    result = {
        "reused": reuse.reused,
        "same_memory": buf.data_ptr() == ptr and buf.numel() == numel,
        "zeroed": int(torch.count_nonzero(buf)) == 0,
        "main_grads_inside": all(
            ptr <= p.main_grad.data_ptr() < ptr + numel * buf.element_size()
            for p in gpt.parameters()
        ),
    }
    gpt.load_state_dict(weights, strict=False)
    step(model, opt, 1)
    grads = buf.clone()
    after = {k: v.clone() for k, v in gpt.state_dict().items() if v is not None}
    release_megatron([gpt], [model], gpt.config)
    del gpt, model, opt
    ps.destroy_model_parallel()

    twin, twin_model, twin_opt = build()  # fresh torch.zeros buffer, same weights
    twin.load_state_dict(weights, strict=False)
    step(twin_model, twin_opt, 1)
    result["grads_equal"] = torch.equal(grads, twin_model.buffers[0].grad_data)
    result["params_equal"] = all(
        torch.equal(after[k], v) for k, v in twin.state_dict().items() if v is not None
    )
    ps.destroy_model_parallel()
    runtime.disable()
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
