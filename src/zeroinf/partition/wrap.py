"""Automatic unit discovery: which modules are gathered and released together.

By default every child of an `nn.ModuleList` / `nn.Sequential` whose children are two or more
instances of one class (the repeated blocks of a transformer) is a unit; the parameters left over
form the root unit. Users may instead name the classes whose instances are units. A parameter
shared by several modules (tied weights) belongs to the first unit that reaches it in module order,
except one that a second unit holds through a module that is never called ([Note: a parameter held
in several units through a container]).

[Note: a parameter held in several units through a container]
A module of another unit that holds a unit's parameter directly and runs gets it gathered on demand
(runtime/stage3_hooks.py, external use). A parameter container has no forward: PEFT's VB-LoRA gives
every adapted layer the one `vblora_vector_bank` (an `nn.ParameterDict`), which each layer's forward
indexes. Owned by the first layer's unit, the bank was the empty placeholder in every other layer at
stage 3 ("index is out of bounds for dimension with size 0"), and no hook could fetch it. Such a
parameter, held in two or more units with a container among its holders, goes to the root unit,
whole on every rank at stage 3 (the bank: num_vectors x vector_length, small).

[Note: large layers outside the blocks are units of their own]
At stage 3 the root unit stays unsharded for the whole run, so what is left outside the blocks
should be small. In a language model it is not: the token embedding and the LM head (2 x vocab x
hidden; 262 MB of a 1.1B Llama in bf16, 2.1 GB of an 8B Llama-3) are a tenth of the model. Given
`split_min_numel`, each `nn.Embedding` or `nn.Linear` outside the units with at least that many
parameters, and at least as many as the smallest block, becomes a unit of its own, gathered only
while it runs, like a block; what stays in the root is the small rest (final norm, position
embeddings). A layer smaller than a block is not worth a unit: it saves less than a block's bytes
and costs a collective a use and, on NVMe, a staging slot (a 1.0B GPT with a 256-token vocabulary,
whose 2 MB embedding and 262 KB positions were split: 13.12 against 12.92 bytes of peak RSS per
parameter, two more staging buffers in flight); `split_any_size` drops that floor. FSDP2 users get
the same by wrapping the embedding and head, DeepSpeed by sharding every parameter. Only these two
exact classes (and classes that declare `zeroinf_splittable = True`), and only when no other module
shares their parameters (tied embeddings stay in the root: the head's forward would read the
embedding's weight outside the embedding's forward): their weights are read by their own forward.
Model code that reads such a weight elsewhere during a pass (DETR's query embeddings, CLIP's
interpolated positions) is caught by `runtime/external_reads.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class UnitSpec:
    """A unit before it is built: its name (module path, "" for the root) and its parameters."""

    name: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]  # (fully qualified name, parameter)
    frozen: bool = False  # a unit of the module's frozen parameters (stage 3), beside its trainable one
    split: bool = False  # a large layer outside the blocks (the Note above), not a block
    order: int = 0  # the module's position in `model.modules()`: the order units run in (the planner's)
    fp32: bool = False  # parameters the model keeps in fp32 (precision.py), beside the unit's others

    @property
    def key(self) -> str:
        """The unit's name among units (swap-file slots): a frozen or fp32 unit is told from its twin."""
        return unit_key(self.name, self.frozen, self.fp32)


def unit_key(name: str, frozen: bool, fp32: bool) -> str:
    """A unit's name among units: its module path, marked when it holds a module's frozen parameters
    or those it keeps in fp32 (twins of the unit of the same module)."""
    return name + ("#frozen" if frozen else "") + ("#fp32" if fp32 else "")


def module_path(key: str) -> str:
    """The module path of the unit named `key` (`unit_key` without its marks)."""
    return key.partition("#")[0]


def _is_repeated_container(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    return len(children) >= 2 and len({type(c) for c in children}) == 1


NESTED_UNITS_ATTR = "zeroinf_nested_units"


SPLIT_CLASSES = (nn.Embedding, nn.Linear)
SPLITTABLE_ATTR = "zeroinf_splittable"  # a layer class that declares its weights are read by its forward only


def _splittable(module: nn.Module, min_numel: int, shared: set[int]) -> bool:
    """A large embedding or linear layer outside the units whose parameters no other module holds."""
    kind_ok = type(module) in SPLIT_CLASSES or getattr(module, SPLITTABLE_ATTR, False)
    if not kind_ok or id(module) in shared:
        return False
    params = list(module.parameters(recurse=False))
    return (
        bool(params)
        and sum(p.numel() for p in params) >= max(1, min_numel)
        and not any(id(p) in shared for p in params)
    )


def _shared_objects(model: nn.Module) -> set[int]:
    """Modules reached by two or more paths and parameters held by two or more modules (tied)."""
    seen_modules: set[int] = set()
    holders: dict[int, int] = {}
    shared: set[int] = set()
    for _, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen_modules:
            shared.add(id(module))
            continue
        seen_modules.add(id(module))
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    shared.update(pid for pid, n in holders.items() if n > 1)
    return shared


def _read_by_several_units(model: nn.Module, unit_paths: set[str]) -> set[int]:
    """Parameters held in two or more units, at least once by a module without a forward ([Note: a
    parameter held in several units through a container])."""
    holders: dict[int, set[str]] = {}
    via_container: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        parts = path.split(".") if path else []
        unit = next((p for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if p in unit_paths), "")
        never_called = type(module).forward is nn.Module.forward
        for p in module._parameters.values():
            if p is None:
                continue
            if unit:
                holders.setdefault(id(p), set()).add(unit)
                if never_called:
                    via_container.add(id(p))
    return {pid for pid in via_container if len(holders[pid]) > 1}


def _unit_modules(
    model: nn.Module, unit_classes: tuple[str, ...], split_min_numel: int | None = None, split_any_size: bool = False
) -> tuple[list[tuple[str, nn.Module, int]], set[str]]:
    """Modules that form units as (path, module, depth), in module order (the root is never one),
    and the paths among them of large layers split from the root.

    Outside any unit, the children of a repeated container are units. Inside a unit, only modules
    that declare `zeroinf_nested_units = True` (e.g. TiledLinear) turn their repeated children into
    nested units. With `unit_classes`, instances of those classes are units at any depth. With
    `split_min_numel`, large layers outside every unit are units too, if at least as large as the
    smallest block unless `split_any_size` ([Note: large layers outside the blocks are units of
    their own]).
    """
    found: list[tuple[str, nn.Module, int]] = []
    split: set[str] = set()
    shared = _shared_objects(model) if split_min_numel is not None else set()

    def visit(prefix: str, module: nn.Module, depth: int) -> None:
        allow_repeated = not unit_classes and (depth == 0 or getattr(module, NESTED_UNITS_ATTR, False))
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if allow_repeated and _is_repeated_container(child):
                for cname, grandchild in child.named_children():
                    found.append((f"{path}.{cname}", grandchild, depth + 1))
                    visit(f"{path}.{cname}.", grandchild, depth + 1)
            elif type(child).__name__ in unit_classes:
                found.append((path, child, depth + 1))
                visit(f"{path}.", child, depth + 1)
            elif depth == 0 and split_min_numel is not None and _splittable(child, split_min_numel, shared):
                found.append((path, child, 1))
                split.add(path)
            else:
                visit(f"{path}.", child, depth)

    if not unit_classes and _is_repeated_container(model):  # the model itself is a Sequential of blocks
        for cname, child in model.named_children():
            found.append((cname, child, 1))
            visit(f"{cname}.", child, 1)
    else:
        visit("", model, 0)
    blocks = [_numel(m) for path, m, depth in found if depth == 1 and path not in split]
    if split and blocks and not split_any_size:
        smallest = min(blocks)
        small = {path for path, m, _ in found if path in split and _numel(m) < smallest}
        found, split = [f for f in found if f[0] not in small], split - small
    return found, split


def _numel(module: nn.Module) -> int:
    """Every parameter of `module`, trainable or not (a unit and its frozen twin decide alike)."""
    return sum(p.numel() for p in module.parameters())


def discover_units(
    model: nn.Module,
    unit_classes: tuple[str, ...] = (),
    trainable_only: bool = True,
    frozen: bool = False,
    split_min_numel: int | None = None,
    split_any_size: bool = False,
    keep_fp32: Callable[[str], bool] | None = None,
) -> list[UnitSpec]:
    """Unit specs in module order, the root unit last; units without parameters are dropped.

    With `trainable_only`, frozen parameters (requires_grad=False) stay out of every unit; with
    `frozen`, the specs hold only the frozen ones (the same modules: a frozen twin of each unit).
    `split_min_numel`, `split_any_size`: see [Note: large layers outside the blocks are units of their own].
    `keep_fp32`: parameters (by full name) kept in fp32 go to a twin of their unit, right after it
    (precision.py [Note: parameters the model keeps in fp32]).
    """
    if unit_classes:
        present = {type(m).__name__ for m in model.modules()}
        missing = [c for c in unit_classes if c not in present]
        if missing:
            raise ValueError(
                f"unit_classes names {missing}, but the model has no module of that class; "
                f"classes present include {sorted(present)[:20]}"
            )
    owner: dict[int, str] = {}
    specs: list[UnitSpec] = []
    found, split = _unit_modules(model, unit_classes, split_min_numel, split_any_size)
    # parameters no unit takes ([Note: a parameter held in several units through a container])
    for_root = _read_by_several_units(model, {path for path, _, _ in found})

    def take(prefix: str, module: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
        params = []
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if id(p) in owner or (trainable_only and not p.requires_grad) or (frozen and p.requires_grad):
                continue
            if prefix and id(p) in for_root:
                continue
            owner[id(p)] = name
            params.append((name, p))
        return tuple(params)

    position = {id(m): i for i, m in enumerate(model.modules())}
    # Nested units take their parameters before the unit around them; specs keep module order.
    taken = {path: take(f"{path}.", module) for path, module, _ in sorted(found, key=lambda f: -f[2])}
    for path, module, _ in found:
        if taken[path]:
            spec = UnitSpec(path, module, taken[path], frozen, path in split, position[id(module)])
            specs += _by_dtype(spec, keep_fp32)
    root_params = take("", model)
    if root_params:
        specs += _by_dtype(UnitSpec("", model, root_params, frozen), keep_fp32)
    return specs


def _by_dtype(spec: UnitSpec, keep_fp32: Callable[[str], bool] | None) -> list[UnitSpec]:
    """`spec`, and its fp32 twin holding the parameters `keep_fp32` names, each when not empty."""
    if keep_fp32 is None:
        return [spec]
    kept = tuple((n, p) for n, p in spec.params if keep_fp32(n))
    if not kept:
        return [spec]
    rest = tuple((n, p) for n, p in spec.params if not keep_fp32(n))
    twin = dataclasses.replace(spec, params=kept, fp32=True)
    return [dataclasses.replace(spec, params=rest), twin] if rest else [twin]
