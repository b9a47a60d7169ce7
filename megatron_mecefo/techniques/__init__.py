"""MeCeFO's three takeover techniques, as Megatron-Core modules chosen per micro-batch.

A *takeover* micro-batch (one absorbed from a failed replica) runs a cheaper backward:
:mod:`.skip_attention` (no backward through the attention branch), :mod:`.ffn_recompute`
(only the FFN input is stored) and :mod:`.lowrank_wgrad` with :mod:`.lowrank_basis`
(``G_W ~ G_y (X V) V^T``). :mod:`.transformer_layer` runs them inside a layer; :mod:`.specs`
rewrites a stock layer spec to use that layer; :mod:`.apply` binds a built model to its
per-process :class:`~.state.MecefoState`, which holds each micro-batch's mode
(:class:`~.config.MecefoConfig` says which techniques are on). :mod:`.activation_bytes`
counts what a forward saves for backward.

Uses: :mod:`megatron_mecefo.gpt` (the stock specs it rewrites). Used by:
:mod:`megatron_mecefo.takeover` (the controller sets the modes), :mod:`megatron_mecefo.megatron_lm`
(spec swap in Megatron-LM) and the benchmarks.
"""
