"""Unit discovery: repeated blocks become units, the rest is the root unit, each parameter in one unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroinf.partition.wrap import UnitSpec, discover_units


class Block(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)


class Tiny(nn.Module):
    def __init__(self, n_blocks: int = 3, vocab: int = 10, dim: int = 4, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight


def _names(spec: UnitSpec) -> list[str]:
    return [name for name, _ in spec.params]


def _all_params(specs: list[UnitSpec]) -> list[nn.Parameter]:
    return [p for s in specs for _, p in s.params]


def test_module_list_of_blocks() -> None:
    model = Tiny(n_blocks=3)
    specs = discover_units(model)
    assert [s.name for s in specs] == ["blocks.0", "blocks.1", "blocks.2", ""]
    for i, spec in enumerate(specs[:3]):
        assert spec.module is model.blocks[i]
        assert _names(spec) == [
            f"blocks.{i}.fc.weight",
            f"blocks.{i}.fc.bias",
            f"blocks.{i}.norm.weight",
            f"blocks.{i}.norm.bias",
        ]
    assert specs[-1].module is model and _names(specs[-1]) == ["emb.weight", "head.weight"]
    # Every parameter in exactly one unit, and the named parameter is the module's own object.
    params = _all_params(specs)
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    named = dict(model.named_parameters())
    assert all(named[n] is p for s in specs for n, p in s.params)


def test_sequential_of_mixed_classes_is_not_split() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    specs = discover_units(model)
    assert len(specs) == 1 and specs[0].name == ""
    assert _names(specs[0]) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_single_child_container_is_not_split() -> None:
    model = nn.Sequential(nn.ModuleList([Block()]), nn.Linear(4, 4))
    assert [s.name for s in discover_units(model)] == [""]


def test_repeated_sequential_is_split() -> None:
    model = nn.Sequential(Block(), Block())
    assert [s.name for s in discover_units(model)] == ["0", "1"]  # no root params left over


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList(Block() for _ in range(2))
        self.proj = nn.Linear(4, 4)


def test_nested_repeated_containers_outermost_wins() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(Outer() for _ in range(2))
    model.out = nn.Linear(4, 2)
    specs = discover_units(model)
    assert [s.name for s in specs] == ["layers.0", "layers.1", ""]
    assert "layers.0.inner.1.fc.weight" in _names(specs[0])
    assert "layers.0.proj.weight" in _names(specs[0])
    assert _names(specs[-1]) == ["out.weight", "out.bias"]


def test_nested_container_below_a_non_repeated_level_is_found() -> None:
    model = nn.Module()
    model.body = Outer()  # not in a repeated container: its inner ModuleList is
    specs = discover_units(model)
    assert [s.name for s in specs] == ["body.inner.0", "body.inner.1", ""]
    assert _names(specs[-1]) == ["body.proj.weight", "body.proj.bias"]


def test_tied_weights_appear_in_one_unit() -> None:
    model = Tiny(tied=True)
    specs = discover_units(model)
    params = _all_params(specs)
    assert sum(p is model.emb.weight for p in params) == 1
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    assert _names(specs[-1]) == ["emb.weight"]  # first name in module order


def test_weight_tied_across_units_goes_to_the_first_unit() -> None:
    model = Tiny(n_blocks=2)
    model.blocks[1].fc.weight = model.blocks[0].fc.weight
    specs = discover_units(model)
    assert "blocks.0.fc.weight" in _names(specs[0])
    assert "blocks.1.fc.weight" not in _names(specs[1])
    params = _all_params(specs)
    assert len(params) == len({id(p) for p in params})


def test_frozen_params_excluded() -> None:
    model = Tiny(n_blocks=2)
    model.emb.weight.requires_grad_(False)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    specs = discover_units(model)
    assert [s.name for s in specs] == ["blocks.1", ""]  # a unit with no trainable params is dropped
    assert _names(specs[-1]) == ["head.weight"]
    assert all(p.requires_grad for p in _all_params(specs))
    everything = discover_units(model, trainable_only=False)
    assert [s.name for s in everything] == ["blocks.0", "blocks.1", ""]
    assert len(_all_params(everything)) == len(list(model.parameters()))


def test_unit_classes_select_by_name_anywhere() -> None:
    model = nn.Module()
    model.first = Block()  # not in a container
    model.stack = nn.Sequential(nn.Linear(4, 4), Block(), nn.ReLU(), Block())  # mixed container
    model.deep = nn.Module()
    model.deep.more = nn.ModuleList([Block()])
    model.head = nn.Linear(4, 2)
    specs = discover_units(model, unit_classes=("Block",))
    assert [s.name for s in specs] == ["first", "stack.1", "stack.3", "deep.more.0", ""]
    assert _names(specs[-1]) == ["stack.0.weight", "stack.0.bias", "head.weight", "head.bias"]


def test_unit_classes_disable_automatic_discovery() -> None:
    model = Tiny(n_blocks=2)
    specs = discover_units(model, unit_classes=("Embedding",))
    assert [s.name for s in specs] == ["emb", ""]  # the repeated blocks are no longer units


def test_unknown_unit_class_raises() -> None:
    with pytest.raises(ValueError, match="TransformerBlock"):
        discover_units(Tiny(), unit_classes=("Block", "TransformerBlock"))


def test_model_without_params() -> None:
    assert discover_units(nn.Sequential(nn.ReLU(), nn.ReLU())) == []
    assert discover_units(nn.Identity()) == []


def test_buffers_are_not_params() -> None:
    model = Tiny(n_blocks=2)
    model.register_buffer("mask", torch.ones(3))
    assert all("mask" not in n for s in discover_units(model) for n in _names(s))


# -- large layers outside the blocks (partition/wrap.py [Note: large layers outside the blocks ...]) --
def test_large_embedding_and_head_are_split_from_the_root() -> None:
    model = Tiny(n_blocks=2, vocab=10, dim=4)  # emb and head: 40 parameters each
    specs = discover_units(model, split_min_numel=40)
    assert [(s.name, s.split) for s in specs] == [
        ("emb", True), ("blocks.0", False), ("blocks.1", False), ("head", True),
    ]  # the root unit had nothing left: dropped
    assert [s.order for s in specs] == sorted(s.order for s in specs)  # module order
    assert [s.name for s in discover_units(model, split_min_numel=41)] == ["blocks.0", "blocks.1", ""]
    assert [s.name for s in discover_units(model)] == ["blocks.0", "blocks.1", ""]  # no split asked


def test_tied_reused_or_subclassed_layers_stay_in_the_root() -> None:
    tied = Tiny(n_blocks=2, tied=True)  # the head's forward reads the embedding's weight
    assert [s.name for s in discover_units(tied, split_min_numel=1)] == ["blocks.0", "blocks.1", ""]

    reused = Tiny(n_blocks=2)
    reused.head2 = reused.head  # one module at two paths: its forward runs twice a pass
    assert [s.name for s in discover_units(reused, split_min_numel=1)] == ["emb", "blocks.0", "blocks.1", ""]

    class Positions(nn.Embedding):  # a subclass may read its weight elsewhere (Whisper's positions do)
        pass

    sub = Tiny(n_blocks=2)
    sub.emb = Positions(10, 4)
    assert [s.name for s in discover_units(sub, split_min_numel=1)] == ["blocks.0", "blocks.1", "head", ""]

    class Declared(Positions):
        zeroinf_splittable = True  # ...unless its class says its forward is the only reader

    sub.emb = Declared(10, 4)
    assert [s.name for s in discover_units(sub, split_min_numel=1)][0] == "emb"


def test_only_layers_outside_every_unit_are_split() -> None:
    model = Tiny(n_blocks=2)
    model.scale = nn.Parameter(torch.ones(4))  # a parameter of the root module itself stays in the root
    specs = discover_units(model, split_min_numel=1)  # the blocks' own Linears stay in their blocks
    assert [s.name for s in specs] == ["emb", "blocks.0", "blocks.1", "head", ""]
    assert _names(specs[1])[:2] == ["blocks.0.fc.weight", "blocks.0.fc.bias"] and not specs[1].split
    assert _names(specs[-1]) == ["scale"]


def test_frozen_twins_split_the_same_layers() -> None:
    model = Tiny(n_blocks=2)
    model.head.requires_grad_(False)
    trainable = discover_units(model, split_min_numel=1)
    frozen = discover_units(model, (), False, True, split_min_numel=1)
    assert [s.name for s in trainable] == ["emb", "blocks.0", "blocks.1"]
    assert [(s.name, s.frozen, s.split) for s in frozen] == [("head", True, True)]


def test_layers_smaller_than_a_block_stay_in_the_root_unless_any_size() -> None:
    model = Tiny(n_blocks=2, vocab=2, dim=4)  # emb and head: 8 parameters; a block: 28
    assert [s.name for s in discover_units(model, split_min_numel=1)] == ["blocks.0", "blocks.1", ""]
    names = [s.name for s in discover_units(model, split_min_numel=1, split_any_size=True)]
    assert names == ["emb", "blocks.0", "blocks.1", "head"]


def test_split_config_fields_are_validated() -> None:
    import zeroinf
    from zeroinf.config import ConfigError

    with pytest.raises(ConfigError, match="split_root"):
        zeroinf.Config(split_root="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="split_root_min_bytes"):
        zeroinf.Config(split_root_min_bytes=-1)
    assert zeroinf.Config(stage=2).split_min_numel is None  # stages 0-2 never split
    assert zeroinf.Config(stage=3, split_root=False).split_min_numel is None
    bf16 = zeroinf.Config(stage=3, param_dtype="bf16", persist_threshold_bytes=4096, split_root_min_bytes=2**20)
    assert bf16.split_min_numel == 2**19
