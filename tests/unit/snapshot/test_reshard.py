"""``reshard`` puts distributed-optimizer shards of a DP4 layout back together for a DP3 rank,
and refuses when an old shard is missing."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.snapshot.contents import reshard


def test_reshard_moves_dp4_shards_to_dp3() -> None:
    """Two parameters split over 4 shards (ranges across parameter borders, as Megatron's
    buffer split does), re-sharded for 3: every element lands where the new map says."""
    sizes = {"model0.a": 10, "model0.b": 6}
    full = {
        name: {key: torch.arange(n, dtype=torch.float32) * (i + 1) + 100 * ord(name[-1])
               for i, key in enumerate(("main", "exp_avg", "exp_avg_sq"))}
        for name, n in sizes.items()
    }  # fmt: skip

    def shards(split: list[list[tuple]]) -> list:
        out = []
        for rows in split:
            meta = {"dist_opt_map": [[0, 0, k, name, s, e] for k, (name, s, e) in enumerate(rows)]}
            tensors = {}
            for k, (name, s, e) in enumerate(rows):
                tensors[f"optim0.main.0.{k}"] = full[name]["main"][s:e].clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    tensors[f"optim0.state.0.{k}.{key}"] = full[name][key][s:e].clone()
                tensors[f"optim0.state.0.{k}.step"] = torch.tensor(5.0)
            out.append((meta, tensors))
        return out

    old = shards([[("model0.a", 0, 4)], [("model0.a", 4, 8)],
                  [("model0.a", 8, 10), ("model0.b", 0, 2)], [("model0.b", 2, 6)]])  # fmt: skip
    new_map = [[0, 0, 0, "model0.a", 5, 10], [0, 0, 1, "model0.b", 0, 1]]  # one DP3 rank
    got = reshard(old, new_map, sizes)
    assert torch.equal(got["optim0.main.0.0"], full["model0.a"]["main"][5:10])
    assert torch.equal(got["optim0.state.0.0.exp_avg_sq"], full["model0.a"]["exp_avg_sq"][5:10])
    assert torch.equal(got["optim0.state.0.1.exp_avg"], full["model0.b"]["exp_avg"][0:1])
    assert float(got["optim0.state.0.1.step"]) == 5.0
    with pytest.raises(ValueError, match="do not cover"):
        reshard(old[:1] + old[2:], new_map, sizes)  # shard 1 (a[4:8]) missing
