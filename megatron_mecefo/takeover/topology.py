"""Which ranks form each data-parallel replica: the failure unit of MeCeFO.

A replica is every TP x CP x PP rank at one data-parallel index. When it fails, the ranks
at the same (tp, cp, pp) coordinates in the other replicas take its micro-batches over, so a
replica's work never has to cross a pipeline or tensor-parallel boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
"""The two rank orders Megatron-LM uses (the second with ``--use-tp-pp-dp-mapping``)."""


@dataclass(frozen=True)
class RankCoordinates:
    """One rank's place in the 4-D grid."""

    tp: int
    cp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class ReplicaTopology:
    """The rank grid of a job, and the ranks of each data-parallel replica.

    Build it with :meth:`build` (sizes and order) or :meth:`from_parallel_state`; the
    coordinates come from megatron-core's own ``RankGenerator``, so they follow Megatron's
    layout for either rank order.
    """

    tensor_parallel_size: int
    context_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    order: str
    coordinates: Tuple[RankCoordinates, ...]
    """Coordinates of every global rank, indexed by rank."""

    @classmethod
    def build(cls, tp: int, cp: int, pp: int, dp: int, order: str = ORDERS[0]) -> ReplicaTopology:
        """Topology of a ``tp * cp * pp * dp``-rank job laid out in Megatron ``order``."""
        from megatron.core.parallel_state import RankGenerator

        if order not in ORDERS:
            raise ValueError(f"rank order {order!r}: use one of {ORDERS}")
        for name, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
            if size < 1:
                raise ValueError(f"{name} size must be positive, got {size}")
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        coord: Dict[int, Dict[str, int]] = {r: {} for r in range(tp * cp * pp * dp)}
        for axis in ("tp", "cp", "pp", "dp"):
            for group in gen.get_ranks(axis):
                for index, rank in enumerate(group):
                    coord[rank][axis] = index
        coords = tuple(RankCoordinates(**coord[r]) for r in range(len(coord)))
        return cls(tp, cp, pp, dp, order, coords)

    @classmethod
    def from_parallel_state(cls, order: str = ORDERS[0]) -> ReplicaTopology:
        """Topology of the running job, from megatron-core's initialized parallel state."""
        from megatron.core import parallel_state as ps

        topo = cls.build(
            tp=ps.get_tensor_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            order=order,
        )
        import torch.distributed as dist

        rank = dist.get_rank()
        mine = topo.coordinates[rank]
        actual = RankCoordinates(
            tp=ps.get_tensor_model_parallel_rank(),
            cp=ps.get_context_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_rank(),
            dp=ps.get_data_parallel_rank(),
        )
        if mine != actual:
            raise RuntimeError(
                f"rank {rank}: rank order {order!r} puts it at {mine}, but megatron-core's "
                f"parallel state says {actual}; pass the order used by initialize_model_parallel"
            )
        return topo

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.coordinates)

    def replica_of(self, rank: int) -> int:
        """The data-parallel index (replica) of global ``rank``."""
        return self.coordinates[rank].dp

    def ranks_of_replica(self, replica: int) -> List[int]:
        """Every global rank of ``replica``: its TP x CP x PP ranks, in rank order."""
        if not 0 <= replica < self.data_parallel_size:
            raise ValueError(f"replica {replica} out of range [0, {self.data_parallel_size})")
        return [r for r, c in enumerate(self.coordinates) if c.dp == replica]

    def describe(self) -> str:
        """One line: the global ranks of every replica."""
        return "; ".join(
            f"replica {r}: ranks {self.ranks_of_replica(r)}" for r in range(self.data_parallel_size)
        )

    def peer_in_replica(self, rank: int, replica: int) -> int:
        """The rank of ``replica`` at the same (tp, cp, pp) coordinates as ``rank``."""
        c = self.coordinates[rank]
        target = RankCoordinates(c.tp, c.cp, c.pp, replica)
        return self.coordinates.index(target)
