"""A trainer without MeCeFO's session (as Megatron-LM's pretrain_gpt.py): env:// init, then
all-reduces until rank 1 SIGKILLs itself at step 5 (tests only)."""

import os
import signal

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
for step in range(1000):
    if step == 5 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))
