"""Building GPT models with Megatron-Core: not MeCeFO, but what the trainer and tests need.

:mod:`.layer_specs` gives the local and Transformer-Engine decoder specs for a config (the
local one with an SP-capable norm, :mod:`.norm`, since Megatron's ``WrappedTorchNorm`` refuses
sequence parallelism); :mod:`.layout_invariant_init` draws every parameter from its
checkpoint-space global tensor, so every TP/PP layout starts from the same model.

Uses: megatron-core only. Used by: the example trainer, :mod:`megatron_mecefo.techniques`
(the stock specs it rewrites), the tests and the benchmarks.
"""
