"""Validation: the loss and perplexity on the first ``--eval-iters`` global batches of the
validation set, through the trainer's own pipeline schedule, forward only."""

from __future__ import annotations

import math
from typing import Any


def evaluate(trainer: Any) -> dict[str, Any]:
    """The ``eval`` record of ``trainer`` at its current iteration (the model in eval mode
    meanwhile, no gradients)."""
    import torch

    for m in trainer.model:
        m.eval()
    with torch.no_grad():
        it = trainer.iterators(trainer.valid_ds, 0)
        losses = [
            trainer.run_schedule(it, forward_only=True) for _ in range(trainer.args.eval_iters)
        ]
    for m in trainer.model:
        m.train()
    loss = sum(losses) / len(losses)
    return {
        "type": "eval",
        "split": "valid",
        "iteration": trainer.iteration,
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
    }
