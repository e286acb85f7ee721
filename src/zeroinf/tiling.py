"""Tiled Linear layers: a huge Linear computed block by block, so only one block is unsharded at a time.

`TiledLinear` is a drop-in for `nn.Linear` whose weight (and bias) is held as `out_splits x
in_splits` tiles, each a `LinearTile` module. `tile_linears` swaps the large `nn.Linear` layers of
an existing model for tiled ones in place, weights carried over, so model code does not change.

[Note: why every tile is a unit]
The tiles sit in one `nn.ModuleList` of one class, so automatic unit discovery
(partition/wrap.py) makes each tile its own unit, and each tile is called as a module. Under
stage 3 the engine's hooks therefore gather a tile right before it runs and release it right
after, forward and backward: the unsharded parameter bytes of the layer are bounded by one tile
(plus whatever the prefetcher gathers ahead). The input slices a tile saves for backward are views
of the layer's input, so tiling adds no saved activations. A layer with one tile has no list of
two or more tiles: its tile joins the unit of the layer's parent, as an untiled Linear would.

[Note: initialization and random numbers]
`nn.Linear` draws its weight from U(-1/sqrt(in_features), 1/sqrt(in_features)) (kaiming_uniform
with a=sqrt(5)) and its bias from the same range. A tile knows the full layer's `fan_in` and draws
from exactly that distribution; drawing from its own, narrower fan_in would be wrong. Tiles draw
their random numbers tile by tile (row-major over tiles, each tile's weight then its bias), so a
TiledLinear initialized from a seed holds the same distribution as an `nn.Linear` from that seed
but not the same values. `LinearTile.reset_parameters` exists so that materialization of a model
built on the meta device, which re-initializes every module that owns parameters directly,
initializes tiles correctly; `TiledLinear.reset_parameters` re-initializes all of its tiles.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

_ENGINE_ATTR = "_zeroinf_engine"  # zeroinf.engine marks sharded modules with it
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def split_sizes(numel: int, splits: int) -> tuple[int, ...]:
    """Sizes of `splits` near-equal pieces of `numel`, the larger pieces first (as `torch.tensor_split`)."""
    q, r = divmod(numel, splits)
    return tuple(q + 1 if i < r else q for i in range(splits))


def _offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return tuple(out)


class LinearTile(nn.Module):
    """One block `weight[rows, cols]` of a `TiledLinear`, and the bias of its rows if it is the first
    tile of its row. `fan_in` is the full layer's `in_features` (see [Note: initialization and random
    numbers]). The parameters are left uninitialized: the owning `TiledLinear` initializes them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fan_in: int,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fan_in = in_features, out_features, fan_in
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw from `nn.Linear`'s distribution for the full layer's fan_in."""
        # kaiming_uniform_(a=sqrt(5)) has bound sqrt(3) * sqrt(2 / (1 + 5)) / sqrt(fan_in) = 1 / sqrt(fan_in).
        bound = 1.0 / math.sqrt(self.fan_in) if self.fan_in > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class TiledLinear(nn.Module):
    """`nn.Linear(in_features, out_features, bias)` held as `out_splits x in_splits` tiles.

    `y[..., rows_o] = sum_j tile_{o,j}(x[..., cols_j])`, concatenated over the output splits; splits
    may be uneven (the sizes of `torch.tensor_split`). Tiles are stored row-major in `self.tiles` and
    run in that order. The bias of output split o lives on tile (o, 0), so it is added once. Results
    equal `nn.Linear`'s within rounding: splitting the input dimension changes the summation order
    (for fp16/bf16 inputs the partial sums are accumulated in fp32). Random initialization has
    `nn.Linear`'s distribution but not its values for the same seed (see [Note: initialization and
    random numbers]).
    """

    # Each tile is its own unit even inside another unit (partition/wrap.py reads this).
    zeroinf_nested_units = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, splits, features in (
            ("in_splits", in_splits, in_features),
            ("out_splits", out_splits, out_features),
        ):
            if not 1 <= splits <= features:
                raise ValueError(
                    f"TiledLinear: {name} = {splits} must be between 1 and the number of features "
                    f"({features}), so that every tile is non-empty"
                )
        self.in_features, self.out_features = in_features, out_features
        self.in_splits, self.out_splits = in_splits, out_splits
        self.in_sizes, self.out_sizes = (
            split_sizes(in_features, in_splits),
            split_sizes(out_features, out_splits),
        )
        self.tiles = nn.ModuleList(
            LinearTile(cols, rows, in_features, bias and j == 0, device=device, dtype=dtype)
            for rows in self.out_sizes
            for j, cols in enumerate(self.in_sizes)
        )
        self.reset_parameters()

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_splits: int = 1, out_splits: int = 1) -> TiledLinear:
        """A TiledLinear holding a copy of `linear`'s weights (on its device, in its dtype, with its
        requires_grad and training mode). Consumes no random numbers. For a `linear` on the meta
        device the result is on the meta device too, with nothing copied."""
        weight, bias = linear.weight, linear.bias
        tiled = cls(
            linear.in_features,
            linear.out_features,
            bias is not None,
            in_splits,
            out_splits,
            device="meta",
            dtype=weight.dtype,
        )
        tiled.train(linear.training)
        if weight.device.type != "meta":
            tiled = tiled.to_empty(device=weight.device)
            with torch.no_grad():
                for tile, rows, cols in tiled.tile_slices():
                    tile.weight.copy_(weight[rows, cols])
                    if tile.bias is not None:
                        assert bias is not None
                        tile.bias.copy_(bias[rows])
        for tile, _, _ in tiled.tile_slices():
            tile.weight.requires_grad_(weight.requires_grad)
            if tile.bias is not None:
                assert bias is not None
                tile.bias.requires_grad_(bias.requires_grad)
        return tiled

    def tile(self, out_index: int, in_index: int) -> LinearTile:
        """The tile of output split `out_index` and input split `in_index`."""
        return self.tiles[out_index * self.in_splits + in_index]  # type: ignore[return-value]

    def tile_slices(self) -> Iterator[tuple[LinearTile, slice, slice]]:
        """(tile, rows, cols) for every tile in order: the block `weight[rows, cols]` of the full layer."""
        for o, (row0, rows) in enumerate(zip(_offsets(self.out_sizes), self.out_sizes, strict=True)):
            for j, (col0, cols) in enumerate(zip(_offsets(self.in_sizes), self.in_sizes, strict=True)):
                yield self.tile(o, j), slice(row0, row0 + rows), slice(col0, col0 + cols)

    def reset_parameters(self) -> None:
        for tile in self.tiles:
            tile.reset_parameters()  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"TiledLinear: input has {x.shape[-1]} features in its last dimension, "
                f"expected in_features = {self.in_features}"
            )
        x_parts = x.split(self.in_sizes, dim=-1)  # views: the saved inputs cost nothing extra
        outs = []
        for o in range(self.out_splits):
            y = self.tile(o, 0)(x_parts[0])
            if self.in_splits > 1:
                out_dtype = y.dtype
                if out_dtype in _LOW_PRECISION:
                    y = y.float()
                for j in range(1, self.in_splits):
                    y = y + self.tile(o, j)(x_parts[j])  # out of place: the hooks may watch tile outputs
                y = y.to(out_dtype)
            outs.append(y)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    # -- whole-layer views for tests and export (gathered copies) ------------------------------------
    def _checked(self, tile: LinearTile, index: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = getattr(tile, name)
        if tuple(tensor.shape) != shape:
            raise RuntimeError(
                f"TiledLinear: tile {index} has {name} of shape {tuple(tensor.shape)}, not {shape}: its unit "
                "is sharded (stage 3); gather it before assembling the full layer"
            )
        return tensor

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """A new [out_features, in_features] tensor: the tiles' weights put together (a gathered copy)."""
        rows = []
        for o, out_size in enumerate(self.out_sizes):
            rows.append(
                torch.cat(
                    [
                        self._checked(self.tile(o, j), o * self.in_splits + j, "weight", (out_size, in_size))
                        for j, in_size in enumerate(self.in_sizes)
                    ],
                    dim=1,
                )
            )
        return torch.cat(rows, dim=0)

    @torch.no_grad()
    def full_bias(self) -> torch.Tensor | None:
        """A new [out_features] tensor: the bias pieces put together (a gathered copy); None without bias."""
        if self.tile(0, 0).bias is None:
            return None
        return torch.cat(
            [
                self._checked(self.tile(o, 0), o * self.in_splits, "bias", (out_size,))
                for o, out_size in enumerate(self.out_sizes)
            ]
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.tile(0, 0).bias is not None}, "
            f"in_splits={self.in_splits}, out_splits={self.out_splits}"
        )


def plan_splits(
    out_features: int, in_features: int, element_bytes: int, max_tile_bytes: int
) -> tuple[int, int]:
    """(out_splits, in_splits) for a weight [out_features, in_features] whose elements take
    `element_bytes`: the fewest tiles whose largest weight block takes at most `max_tile_bytes`;
    among those the squarest block (long side over short side); among those, more output splits
    (splitting outputs needs no partial sums)."""
    if element_bytes > max_tile_bytes:
        raise ValueError(
            f"max_tile_bytes = {max_tile_bytes} is smaller than one weight element "
            f"({element_bytes} bytes); use a larger budget"
        )
    best: tuple[tuple[int, float, int], tuple[int, int]] | None = None
    for out_splits in range(1, out_features + 1):
        if best is not None and out_splits > best[0][0]:
            break  # tiles = out_splits * in_splits can only grow from here
        rows = math.ceil(out_features / out_splits)
        max_cols = max_tile_bytes // (rows * element_bytes)
        if max_cols == 0:
            continue
        in_splits = math.ceil(in_features / max_cols)
        cols = math.ceil(in_features / in_splits)
        key = (out_splits * in_splits, max(rows, cols) / min(rows, cols), -out_splits)
        if best is None or key < best[0]:
            best = (key, (out_splits, in_splits))
    assert best is not None  # out_splits = out_features always fits: one row of one element fits
    return best[1]


def tile_linears(model: nn.Module, max_tile_bytes: int, dtype_bytes: int | None = None) -> int:
    """Replace, in place, every `nn.Linear` of `model` whose weight takes more than `max_tile_bytes`
    by a `TiledLinear` with the same weights whose tiles each fit (see `plan_splits`); return how
    many layers were replaced.

    `dtype_bytes` is the size of one weight element to budget for (default: the weight's current
    element size; pass 2 for a model built in fp32 but trained in bf16). Only modules of exactly
    the class `nn.Linear` are replaced: subclasses may read their weight directly (as
    `nn.MultiheadAttention` does with its `out_proj`). A Linear whose parameters are shared with
    another module (tied weights, such as an LM head tied to the embedding) is left alone with a
    warning, since tiling would break the tie. Parameters on the meta device (a model built under
    `zeroinf.init` or `torch.device("meta")`) give meta tiles and copy nothing, so the untiled weight
    never exists. Call it before `zeroinf.shard` and before building an optimizer; hooks registered
    on a replaced Linear do not carry over.
    """
    if max_tile_bytes <= 0:
        raise ValueError(f"tile_linears: max_tile_bytes = {max_tile_bytes} must be positive")
    if hasattr(model, _ENGINE_ATTR):
        raise RuntimeError("tile_linears: the model is already sharded; tile it before zeroinf.shard")
    if type(model) is nn.Linear:
        raise TypeError(
            "tile_linears replaces layers inside a model; for a bare nn.Linear use TiledLinear.from_linear"
        )
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    targets = [
        (f"{parent_name}.{name}" if parent_name else name, parent, name, child)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    replaced, seen = 0, set()
    for path, parent, name, linear in targets:
        if id(linear) in seen:
            continue
        seen.add(id(linear))
        weight = linear.weight
        element_bytes = dtype_bytes or weight.element_size()
        if weight.numel() * element_bytes <= max_tile_bytes:
            continue
        if any(uses[id(p)] > 1 for p in linear.parameters()):
            warnings.warn(
                f"tile_linears: {path} shares its parameters with another module (tied weights); "
                "it stays untiled, since tiling would break the tie",
                stacklevel=2,
            )
            continue
        out_splits, in_splits = plan_splits(
            linear.out_features, linear.in_features, element_bytes, max_tile_bytes
        )
        setattr(parent, name, TiledLinear.from_linear(linear, in_splits=in_splits, out_splits=out_splits))
        replaced += 1
    return replaced
