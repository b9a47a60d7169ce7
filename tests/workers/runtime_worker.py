"""One gloo rank: a real megatron-core training step with CPU-runtime layers left out.

Prints one JSON line: for each configuration, whether the step succeeded and the error.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def one_step(skip: list[str]) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mecefo.gpt.layer_specs import gpt_decoder_spec
    from megatron_mecefo.runtime import CpuRuntime

    runtime = CpuRuntime(skip_layers=skip).enable()
    try:
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1, force_reset_rng=True)
        cfg = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
            pipeline_dtype=torch.float32,
        )  # fmt: skip
        gpt = GPTModel(config=cfg, transformer_layer_spec=gpt_decoder_spec(cfg), vocab_size=64,
                       max_sequence_length=16, position_embedding_type="rope")  # fmt: skip
        model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), gpt)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0), [model])
        cfg.finalize_model_grads_func = finalize_model_grads
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

        def step(it, m):
            out = m(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
            return out, lambda o: (o.sum(), torch.tensor(o.numel()), {"l": o.sum().detach()})

        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]),
                                    model=model, num_microbatches=1, seq_length=16,
                                    micro_batch_size=2)  # fmt: skip
        ok, grad_norm, _ = opt.step()
        return {"ok": bool(ok) and grad_norm > 0, "error": None}
    except Exception as err:  # noqa: BLE001 - the point is to see what breaks
        return {"ok": False, "error": f"{type(err).__name__}: {str(err)[:200]}"}
    finally:
        ps.destroy_model_parallel()
        runtime.disable()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    results = {layer: one_step([layer]) for layer in sys.argv[1:]}
    results["<all layers>"] = one_step([])
    print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
