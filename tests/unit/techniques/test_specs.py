"""MeCeFO layer specs, config and state: rewriting and validation, without a process group."""

from __future__ import annotations

import copy
import functools

import pytest
from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_mecefo.techniques import specs
from megatron_mecefo.techniques.config import MecefoConfig
from megatron_mecefo.techniques.lowrank_wgrad import (
    LowRankColumnParallelLinear,
    LowRankRowParallelLinear,
)
from megatron_mecefo.techniques.specs import MecefoSpecError, mecefo_spec
from megatron_mecefo.techniques.state import MecefoState, MicrobatchMode
from megatron_mecefo.techniques.transformer_layer import MecefoTransformerLayer


def _linears(layer_spec):
    mlp = layer_spec.submodules.mlp
    subs = mlp.submodules if isinstance(mlp, ModuleSpec) else mlp.keywords["submodules"]
    return subs.linear_fc1, subs.linear_fc2


def test_local_spec_rewrite_is_a_copy():
    stock = gpt_layer_specs.get_gpt_layer_local_spec()
    before = copy.deepcopy(stock)
    spec = mecefo_spec(stock)
    assert spec.module is MecefoTransformerLayer
    assert _linears(spec) == (LowRankColumnParallelLinear, LowRankRowParallelLinear)
    assert spec.submodules.self_attention == before.submodules.self_attention
    # The stock factory's object is untouched.
    assert stock.module is TransformerLayer
    assert _linears(stock) == (ColumnParallelLinear, RowParallelLinear)
    assert mecefo_spec(spec).module is MecefoTransformerLayer  # idempotent


def test_lowrank_false_keeps_the_linears():
    spec = mecefo_spec(gpt_layer_specs.get_gpt_layer_local_spec(), lowrank=False)
    assert spec.module is MecefoTransformerLayer
    assert _linears(spec) == (ColumnParallelLinear, RowParallelLinear)


class _BuilderMLP(MLP):
    """megatron-core >= 0.18 puts ``partial(MLP.as_mlp_submodule, submodules=...)`` in specs."""

    @classmethod
    def as_mlp_submodule(cls, submodules, config, **kwargs):
        return cls(config=config, submodules=submodules, **kwargs)


def test_partial_mlp_form_is_rewritten():
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    spec.submodules.mlp = functools.partial(
        _BuilderMLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    out = mecefo_spec(spec)
    assert isinstance(out.submodules.mlp, functools.partial)
    assert out.submodules.mlp.func == _BuilderMLP.as_mlp_submodule
    assert _linears(out) == (LowRankColumnParallelLinear, LowRankRowParallelLinear)
    assert _linears(spec) == (ColumnParallelLinear, RowParallelLinear)


class FakeTELayerNormColumn(ColumnParallelLinear):
    """Stand-ins: without TE installed, megatron-core's TE classes are MagicMocks."""


class FakeTERow(RowParallelLinear):
    pass


class FakeTENorm:
    pass


class FakeTEAttention:
    pass


@pytest.fixture
def te_classes(monkeypatch):
    for name, cls in {"TELayerNormColumnParallelLinear": FakeTELayerNormColumn,
                      "TERowParallelLinear": FakeTERow, "TENorm": FakeTENorm}.items():  # fmt: skip
        monkeypatch.setattr(te_ext, name, cls)


def _te_like_spec() -> ModuleSpec:
    """The dense TE spec's structure (its factory cannot run without TE installed)."""
    subs = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec().submodules)
    subs.input_layernorm = IdentityOp
    subs.pre_mlp_layernorm = IdentityOp
    subs.self_attention.submodules.linear_qkv = FakeTELayerNormColumn
    subs.self_attention.submodules.core_attention = FakeTEAttention
    subs.self_attention.submodules.linear_proj = FakeTERow
    subs.mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=FakeTELayerNormColumn, linear_fc2=FakeTERow))  # fmt: skip
    subs.sharded_state_dict_keys_map = {}
    return ModuleSpec(module=TransformerLayer, submodules=subs)


def test_te_spec_keeps_te_attention_and_unfuses_the_mlp_norm(te_classes):
    spec = mecefo_spec(_te_like_spec())
    subs = spec.submodules
    assert subs.self_attention.submodules.linear_qkv is FakeTELayerNormColumn
    assert subs.self_attention.submodules.core_attention is FakeTEAttention
    assert subs.input_layernorm is IdentityOp
    assert subs.pre_mlp_layernorm is FakeTENorm
    assert _linears(spec) == (LowRankColumnParallelLinear, LowRankRowParallelLinear)
    # The un-fused norm keeps the fused checkpoint key.
    assert subs.sharded_state_dict_keys_map == {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    kept = mecefo_spec(_te_like_spec(), lowrank=False).submodules
    assert kept.pre_mlp_layernorm is IdentityOp
    assert kept.mlp.submodules.linear_fc1 is FakeTELayerNormColumn


def test_te_op_fuser_mlp_is_rejected(monkeypatch):
    class FakeTEFusedMLP(MLP):
        pass

    monkeypatch.setattr(te_ext, "TEFusedMLP", FakeTEFusedMLP)
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    spec.submodules.mlp.module = FakeTEFusedMLP
    with pytest.raises(MecefoSpecError, match="use_te_op_fuser"):
        mecefo_spec(spec)


def test_block_spec_rewrites_every_layer():
    layer = gpt_layer_specs.get_gpt_layer_local_spec()
    block = TransformerBlockSubmodules(layer_specs=[layer, layer, layer])
    out = mecefo_spec(block)
    assert [s.module for s in out.layer_specs] == [MecefoTransformerLayer] * 3
    assert all(_linears(s)[0] is LowRankColumnParallelLinear for s in out.layer_specs)


def test_moe_and_foreign_layers_are_rejected():
    moe = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4)
    with pytest.raises(MecefoSpecError, match="MoE layers are not supported"):
        mecefo_spec(moe)
    assert mecefo_spec(moe, lowrank=False).module is MecefoTransformerLayer

    class MyLayer(TransformerLayer):
        pass

    custom = gpt_layer_specs.get_gpt_layer_local_spec()
    custom.module = MyLayer
    with pytest.raises(MecefoSpecError, match="inherit from MecefoTransformerLayer"):
        mecefo_spec(custom)


def test_ready_made_specs_and_callable():
    assert specs.mecefo_local_spec.module is MecefoTransformerLayer
    assert specs.mecefo_te_spec is None  # no Transformer Engine on this machine
    with pytest.raises(RuntimeError, match="needs Transformer Engine"):
        specs.get_mecefo_te_spec()
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               transformer_impl="local")  # fmt: skip
    spec = specs.mecefo_layer_spec(config)
    assert spec.module is MecefoTransformerLayer
    assert _linears(spec) == (LowRankColumnParallelLinear, LowRankRowParallelLinear)


@pytest.mark.parametrize(
    "field,value,match",
    [("rank", 0, "rank=0"), ("basis_interval", 0, "basis_interval=0"),
     ("basis_method", "svd", "basis_method='svd'"), ("basis_dtype", "bfloat16", "basis_dtype"),
     ("randomized_power_iters", -1, "randomized_power_iters")],
)  # fmt: skip
def test_config_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        MecefoConfig(**{field: value})


def test_state_plan_and_counters():
    state = MecefoState(MecefoConfig())
    chunk_a, chunk_b = object(), object()
    assert state.current_mode is MicrobatchMode.EXACT  # before any plan
    state.start_step(5, ["exact", "takeover"])
    assert state.num_takeover == 1 and state.mixes_modes
    # Each model chunk walks the plan in order (interleaved pipelines).
    assert state.begin_microbatch(chunk_a) is MicrobatchMode.EXACT
    assert state.begin_microbatch(chunk_b) is MicrobatchMode.EXACT
    assert state.begin_microbatch(chunk_a) is MicrobatchMode.TAKEOVER
    with pytest.raises(RuntimeError, match="has 2 micro-batches"):
        state.begin_microbatch(chunk_a)
    with pytest.raises(ValueError, match="must not go back"):
        state.start_step(4, ["exact"])
    digest = state.plan_digest()
    state.start_step(5, ["takeover", "exact"])
    assert state.plan_digest() != digest
    assert state.basis_is_stale(None) and not state.basis_is_stale(5)
    state.reset()
    assert state.step == -1 and state.modes == () and state.basis_refreshes == []


def _lowrank_case(fusion: bool):
    import torch

    from megatron_mecefo.techniques.lowrank_wgrad import LowRankWgradLinear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 16, generator=gen, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(12, 16, generator=gen))
    weight.main_grad = torch.zeros(12, 16)
    weight.grad_added_to_main_grad = False
    basis = torch.linalg.qr(torch.randn(16, 4, generator=gen)).Q
    y = LowRankWgradLinear.apply(x, weight, None, basis, False, fusion, False, False, None)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    g2, x2 = g.reshape(-1, 12), x.detach().reshape(-1, 16)
    expected = g2.T @ (x2 @ basis) @ basis.T
    return x, weight, g, expected


def test_lowrank_function_main_grad_paths():
    import torch

    # gradient_accumulation_fusion off: the gradient is returned, the DDP hook adds it.
    x, weight, g, expected = _lowrank_case(fusion=False)
    torch.testing.assert_close(weight.grad, expected, rtol=1e-5, atol=1e-5)
    assert not weight.main_grad.any() and not weight.grad_added_to_main_grad
    torch.testing.assert_close(x.grad, g @ weight.detach(), rtol=0, atol=0)  # dgrad is exact
    # On: accumulated into main_grad here, flagged, and a dummy handed to autograd.
    x, weight, g, expected = _lowrank_case(fusion=True)
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-5, atol=1e-5)
    assert weight.grad_added_to_main_grad


def test_randomized_basis_spans_the_top_singular_subspace():
    import torch

    from megatron_mecefo.techniques.lowrank_basis import compute_basis

    gen = torch.Generator().manual_seed(1)
    u = torch.linalg.qr(torch.randn(96, 48, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(48, 48, generator=gen)).Q
    weight = (u * torch.logspace(0, -3, 48)) @ v.T  # decaying spectrum, [out=96, in=48]
    top = v[:, :8]
    for mode, w in (("column", weight), ("row", weight.T.contiguous())):
        exact = compute_basis(w, mode, MecefoConfig(rank=8), None)
        fast = compute_basis(w, mode, MecefoConfig(rank=8, basis_method="randomized"), None)
        ref = top if mode == "column" else torch.linalg.svd(w, full_matrices=False).Vh[:8].T
        for basis in (exact, fast):
            assert basis.shape == (w.shape[1], 8)
            torch.testing.assert_close(basis.T @ basis, torch.eye(8), rtol=0, atol=1e-5)
            torch.testing.assert_close(basis @ basis.T, ref @ ref.T, rtol=0, atol=1e-4)
