"""The CPU launcher's per-rank distributed-optimizer shard (issue 12, item 15).

The resume itself runs end to end in Megatron-LM's loop in
``tests/integration/megatron_lm/test_patched_megatron_lm.py::test_distributed_optimizer_resume_equals_plain_optimizer_resume``
(slow, needs ``MEGATRON_LM_DIR``); here, the error for a checkpoint without this rank's shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_mecefo.runtime.megatron_lm_cpu_checkpoint import load_shard


def test_missing_shard_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "iter_0000002" / "cpu_dist_optimizer" / "tp0of1_pp0of1_dp0of2.pt")
    with pytest.raises(RuntimeError) as info:
        load_shard(path, optimizer=object(), scheduler=None)
    message = str(info.value)
    assert path in message and "--no-load-optim" in message and "TP/PP/DP" in message
