"""TiledLinear and tile_linears: nn.Linear's results, weights carried over, tiles as units, meta device."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from zeroinf.partition.wrap import discover_units
from zeroinf.tiling import LinearTile, TiledLinear, plan_splits, split_sizes, tile_linears

IN, OUT = 10, 7
SPLITS = [(1, 1), (2, 3), (3, 2)]  # (in_splits, out_splits); 10 and 7 split unevenly


def _full_grad(layer: TiledLinear, name: str) -> torch.Tensor:
    """The tiles' gradients of `name` ("weight" or "bias") put together like full_weight()."""
    if name == "bias":
        return torch.cat([layer.tile(o, 0).bias.grad for o in range(layer.out_splits)])
    return torch.cat(
        [
            torch.cat([layer.tile(o, j).weight.grad for j in range(layer.in_splits)], dim=1)
            for o in range(layer.out_splits)
        ]
    )


def _forward_backward(
    layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad_out)
    return y.detach(), x.grad


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"in{s[0]}xout{s[1]}")
def test_matches_linear_forward_and_backward(splits: tuple[int, int], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(IN, OUT, bias=bias)
    tiled = TiledLinear.from_linear(linear, in_splits=splits[0], out_splits=splits[1])
    x, grad_out = torch.randn(2, 5, IN), torch.randn(2, 5, OUT)
    y_ref, gx_ref = _forward_backward(linear, x, grad_out)
    y, gx = _forward_backward(tiled, x, grad_out)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(_full_grad(tiled, "weight"), linear.weight.grad)
    if bias:
        torch.testing.assert_close(_full_grad(tiled, "bias"), linear.bias.grad)
    else:
        assert tiled.full_bias() is None and all(t.bias is None for t in tiled.tiles)


def test_matches_linear_in_bf16() -> None:
    """Within bf16 rounding of the fp32 result (relative to the magnitudes), forward and gradients."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    tiled = TiledLinear.from_linear(linear, in_splits=3, out_splits=2)
    exact = TiledLinear.from_linear(linear.float(), in_splits=1, out_splits=1)  # fp32 from the same weights
    x, grad_out = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 48, dtype=torch.bfloat16)
    want = _forward_backward(exact, x.float(), grad_out.float())
    got = _forward_backward(tiled, x, grad_out)
    assert got[0].dtype == torch.bfloat16 and tiled.full_weight().dtype == torch.bfloat16
    grads = [(_full_grad(tiled, n), _full_grad(exact, n)) for n in ("weight", "bias")]
    for actual, expected in [*zip(got, want, strict=True), *grads]:
        atol = 2**-7 * expected.abs().max().item()  # two bf16 ulps of the largest entry
        torch.testing.assert_close(actual.float(), expected, rtol=0, atol=atol)


def test_from_linear_round_trip() -> None:
    linear = nn.Linear(IN, OUT)
    linear.bias.requires_grad_(False)
    linear.eval()
    tiled = TiledLinear.from_linear(linear, in_splits=3, out_splits=2)
    assert torch.equal(tiled.full_weight(), linear.weight)
    assert torch.equal(tiled.full_bias(), linear.bias)
    assert [t.bias is not None for t in tiled.tiles] == [True, False, False, True, False, False]
    assert all(t.weight.requires_grad for t in tiled.tiles)
    assert not tiled.tile(1, 0).bias.requires_grad and not tiled.training
    assert [tuple(t.weight.shape) for t in tiled.tiles] == [(4, 4), (4, 3), (4, 3), (3, 4), (3, 3), (3, 3)]
    assert split_sizes(IN, 3) == tuple(p.shape[0] for p in torch.arange(IN).tensor_split(3))
    assert "in_features=10, out_features=7, bias=True, in_splits=3, out_splits=2" in repr(tiled)


def test_full_weight_refuses_a_sharded_tile() -> None:
    tiled = TiledLinear(IN, OUT, in_splits=2)
    tiled.tile(0, 1).weight.data = torch.empty(0)  # what a resharded stage-3 unit looks like
    with pytest.raises(RuntimeError, match="tile 1 .* sharded"):
        tiled.full_weight()


@pytest.mark.parametrize("bad", [dict(in_splits=0), dict(in_splits=IN + 1), dict(out_splits=OUT + 1)])
def test_rejects_empty_tiles(bad: dict) -> None:
    with pytest.raises(ValueError, match="every tile is non-empty"):
        TiledLinear(IN, OUT, **bad)


def _assert_linear_init(tiled: TiledLinear) -> None:
    """Weights and bias drawn from U(-1/sqrt(in_features), 1/sqrt(in_features)), as nn.Linear's."""
    bound = 1 / math.sqrt(tiled.in_features)
    weight, bias = tiled.full_weight(), tiled.full_bias()
    assert weight.abs().max() <= bound and bias.abs().max() <= bound  # a tile's own fan_in would exceed it
    assert weight.abs().max() > 0.95 * bound
    assert abs(weight.std().item() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)


def test_init_uses_the_full_layer_fan_in() -> None:
    torch.manual_seed(0)
    _assert_linear_init(TiledLinear(256, 96, in_splits=4, out_splits=3))


class Net(nn.Module):
    """A small model with one large Linear among small ones, optionally with a tied head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.small = nn.Linear(8, 8)
        self.body = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))  # 2 KiB weights in fp32
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.head(self.body(self.small(h)) + h)


def test_tile_linears_replaces_only_large_layers() -> None:
    torch.manual_seed(0)
    model = Net()
    idx = torch.randint(0, 16, (3, 5))
    before = model(idx)
    rng = torch.get_rng_state()
    assert tile_linears(model, max_tile_bytes=600) == 2
    assert torch.equal(torch.get_rng_state(), rng)  # carrying weights over draws no random numbers
    assert type(model.small) is nn.Linear and type(model.head) is nn.Linear  # 256 and 512 bytes
    for layer in (model.body[0], model.body[2]):
        assert isinstance(layer, TiledLinear)
        assert len(layer.tiles) == 4  # 2048 bytes into tiles of at most 600
        assert all(t.weight.numel() * 4 <= 600 for t in layer.tiles)
    torch.testing.assert_close(model(idx), before)
    assert tile_linears(model, max_tile_bytes=600) == 0  # already tiled


def test_tile_linears_budgets_for_dtype_bytes() -> None:
    model = Net()
    assert tile_linears(model, max_tile_bytes=1024, dtype_bytes=2) == 0  # 2 KiB in fp32 is 1 KiB in bf16
    assert tile_linears(model, max_tile_bytes=1023, dtype_bytes=2) == 2


def test_tile_linears_skips_tied_layers_with_a_warning() -> None:
    model = Net(tied=True)
    with pytest.warns(UserWarning, match="head shares its parameters"):
        assert tile_linears(model, max_tile_bytes=300) == 2
    assert type(model.head) is nn.Linear and model.head.weight is model.emb.weight


def test_tile_linears_leaves_linear_subclasses_alone() -> None:
    attn = nn.MultiheadAttention(16, 2)  # reads out_proj.weight directly: replacing it would break it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tile_linears(attn, max_tile_bytes=64) == 0


def test_tile_linears_on_the_meta_device_then_materialize() -> None:
    with torch.device("meta"):
        model = Net()
        assert tile_linears(model, max_tile_bytes=600) == 2
    assert all(p.is_meta for p in model.parameters())
    assert isinstance(model.body[0], TiledLinear) and model.body[0].tile(1, 1).weight.is_meta
    # What materialization does: real storage, then reset_parameters of each module owning parameters.
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    for layer in (model.body[0], model.body[2]):
        _assert_linear_init(layer)


def test_plan_splits_examples() -> None:
    assert plan_splits(8, 8, 4, 256) == (1, 1)
    assert plan_splits(8, 8, 4, 128) == (2, 1)  # equally square: split the outputs
    assert plan_splits(8, 32, 4, 512) == (1, 2)  # 8x16 tiles rather than 4x32
    assert plan_splits(4096, 4096, 2, 2**20) == (8, 4)  # 32 tiles of 512 x 1024
    with pytest.raises(ValueError, match="smaller than one weight element"):
        plan_splits(8, 8, 4, 3)


def test_plan_splits_is_minimal_and_fits() -> None:
    def worst_tile_bytes(out_f: int, in_f: int, os_: int, is_: int, eb: int) -> int:
        return math.ceil(out_f / os_) * math.ceil(in_f / is_) * eb

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        out_f, in_f = (int(v) for v in torch.randint(1, 40, (2,), generator=g))
        eb = int(torch.randint(1, 5, (1,), generator=g))
        budget = int(torch.randint(eb, out_f * in_f * eb + 1, (1,), generator=g))
        os_, is_ = plan_splits(out_f, in_f, eb, budget)
        assert worst_tile_bytes(out_f, in_f, os_, is_, eb) <= budget
        fewest = min(
            a * b
            for a, b in itertools.product(range(1, out_f + 1), range(1, in_f + 1))
            if worst_tile_bytes(out_f, in_f, a, b, eb) <= budget
        )
        assert os_ * is_ == fewest, (out_f, in_f, eb, budget)


def test_every_tile_is_its_own_unit() -> None:
    model = nn.Module()
    model.norm = nn.LayerNorm(IN)
    model.fc = TiledLinear(IN, OUT, in_splits=2, out_splits=3)
    specs = discover_units(model)
    assert [s.name for s in specs] == [f"fc.tiles.{k}" for k in range(6)] + [""]
    for spec, tile in zip(specs, model.fc.tiles, strict=False):
        assert spec.module is tile and [p for _, p in spec.params] == list(tile.parameters())
    assert [n for n, _ in specs[-1].params] == ["norm.weight", "norm.bias"]
    assert isinstance(model.fc.tiles[0], LinearTile)


class Regressor(nn.Module):
    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.inp, self.proj = nn.Linear(6, 12), proj

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.proj(F.gelu(self.inp(x))), y)


def test_stage2_training_matches_plain_linear() -> None:
    import zeroinf

    torch.manual_seed(0)
    reference = Regressor(nn.Linear(12, 9))
    tiled = Regressor(TiledLinear.from_linear(reference.proj, in_splits=2, out_splits=3))
    tiled.inp.load_state_dict(reference.inp.state_dict())
    tiled = zeroinf.shard(tiled, zeroinf.Config(stage=2))
    assert zeroinf.memory_report(tiled)["units"] == 7  # six tiles and the root
    opt = zeroinf.AdamW(tiled, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 9, generator=g)
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = tiled(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled.proj.full_weight(), reference.proj.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled.proj.full_bias(), reference.proj.bias.detach(), rtol=1e-5, atol=1e-6)
