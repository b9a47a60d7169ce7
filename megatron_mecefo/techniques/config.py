"""``MecefoConfig``: which takeover techniques run, and how the low-rank basis is built."""

from __future__ import annotations

from dataclasses import dataclass

BASIS_METHODS = ("eigh", "randomized")
BASIS_DTYPES = ("float32", "float64")


@dataclass
class MecefoConfig:
    """Configuration of MeCeFO's takeover mode (arXiv 2510.16415, §3).

    Exact micro-batches are never affected by these fields; they select what a *takeover*
    micro-batch does.
    """

    skip_attention: bool = True
    """Skip-connection: the attention branch (input norm, self-attention, its bias and
    dropout) runs its forward exactly but saves nothing and contributes no gradient; the
    residual path alone carries the gradient to the layer input."""

    recompute_ffn: bool = True
    """FFN recomputation: store only the FFN block input (the residual stream after the
    attention add); the pre-MLP norm and the MLP are recomputed in backward."""

    lowrank_ffn: bool = True
    """Low-rank FFN weight gradients: fc1 (gate and up) and fc2 compute the input gradient
    exactly and the weight gradient as ``G_yᵀ (X V) Vᵀ``, saving ``X V`` instead of ``X``."""

    rank: int = 128
    """r, the number of top right singular vectors of each FFN weight kept in V. It is capped
    per weight at min(out, in) of the full, unsharded weight. 128 is the rank of the
    GaLore/GoLore pre-training recipes of the paper's group; at LLaMA-7B shapes it makes the
    low-rank weight gradient about 7% of the exact one's FLOPs."""

    basis_interval: int = 200
    """τ, in optimizer steps: V is recomputed on first use and then at the first takeover
    step at least τ steps after the last refresh. 200 is GoLore's ``update_proj_gap``; a
    refresh costs one Gram matrix and one eigendecomposition per FFN weight."""

    basis_method: str = "eigh"
    """``"eigh"``: exact eigendecomposition of the TP-all-reduced Gram matrix.
    ``"randomized"``: seeded randomized subspace iteration, which all-reduces only
    ``[dim, r + oversample]`` blocks and avoids the ``dim³`` eigendecomposition; for large
    shapes."""

    basis_dtype: str = "float32"
    """Dtype of the Gram matrices and eigendecomposition (``"float32"`` or ``"float64"``).
    The basis is never computed in bf16/fp16, whatever the parameter dtype."""

    randomized_oversample: int = 8
    """Extra columns of the randomized range finder (``basis_method="randomized"``)."""

    randomized_power_iters: int = 2
    """Subspace (power) iterations of the randomized range finder."""

    seed: int = 1234
    """Seed of the randomized range finder; identical on every rank, so every rank of a TP
    group draws the same test matrix."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def any_technique(self) -> bool:
        """Whether a takeover micro-batch differs from an exact one at all."""
        return self.skip_attention or self.recompute_ffn or self.lowrank_ffn

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, the value and the fix."""
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"MecefoConfig.rank={self.rank!r}: must be a positive integer")
        if not isinstance(self.basis_interval, int) or self.basis_interval < 1:
            raise ValueError(
                f"MecefoConfig.basis_interval={self.basis_interval!r}: must be a positive "
                "number of optimizer steps"
            )
        if self.basis_method not in BASIS_METHODS:
            raise ValueError(
                f"MecefoConfig.basis_method={self.basis_method!r}: use one of {BASIS_METHODS}"
            )
        if self.basis_dtype not in BASIS_DTYPES:
            raise ValueError(
                f"MecefoConfig.basis_dtype={self.basis_dtype!r}: use one of {BASIS_DTYPES}"
            )
        if self.randomized_oversample < 0:
            raise ValueError(
                f"MecefoConfig.randomized_oversample={self.randomized_oversample!r}: must be "
                ">= 0"
            )
        if self.randomized_power_iters < 0:
            raise ValueError(
                f"MecefoConfig.randomized_power_iters={self.randomized_power_iters!r}: must "
                "be >= 0"
            )
