"""Automatic unit discovery: which modules are gathered and released together.

By default every child of an `nn.ModuleList` / `nn.Sequential` whose children are two or more
instances of one class (the repeated blocks of a transformer) is a unit; the parameters left over
form the root unit. Users may instead name the classes whose instances are units. A parameter
shared by several modules (tied weights) belongs to the first unit that reaches it in module order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class UnitSpec:
    """A unit before it is built: its name (module path, "" for the root) and its parameters."""

    name: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]  # (fully qualified name, parameter)
    frozen: bool = False  # a unit of the module's frozen parameters (stage 3), beside its trainable one

    @property
    def key(self) -> str:
        """The unit's name among units (swap-file slots): a frozen unit is told from its trainable twin."""
        return f"{self.name}#frozen" if self.frozen else self.name


def _is_repeated_container(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    return len(children) >= 2 and len({type(c) for c in children}) == 1


NESTED_UNITS_ATTR = "zeroinf_nested_units"


def _unit_modules(model: nn.Module, unit_classes: tuple[str, ...]) -> list[tuple[str, nn.Module, int]]:
    """Modules that form units as (path, module, depth), in module order; the root is never one.

    Outside any unit, the children of a repeated container are units. Inside a unit, only modules
    that declare `zeroinf_nested_units = True` (e.g. TiledLinear) turn their repeated children into
    nested units. With `unit_classes`, instances of those classes are units at any depth.
    """
    found: list[tuple[str, nn.Module, int]] = []

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
            else:
                visit(f"{path}.", child, depth)

    if not unit_classes and _is_repeated_container(model):  # the model itself is a Sequential of blocks
        for cname, child in model.named_children():
            found.append((cname, child, 1))
            visit(f"{cname}.", child, 1)
    else:
        visit("", model, 0)
    return found


def discover_units(
    model: nn.Module, unit_classes: tuple[str, ...] = (), trainable_only: bool = True, frozen: bool = False
) -> list[UnitSpec]:
    """Unit specs in module order, the root unit last; units without parameters are dropped.

    With `trainable_only`, frozen parameters (requires_grad=False) stay out of every unit; with
    `frozen`, the specs hold only the frozen ones (the same modules: a frozen twin of each unit).
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

    def take(prefix: str, module: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
        params = []
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if id(p) in owner or (trainable_only and not p.requires_grad) or (frozen and p.requires_grad):
                continue
            owner[id(p)] = name
            params.append((name, p))
        return tuple(params)

    found = _unit_modules(model, unit_classes)
    # Nested units take their parameters before the unit around them; specs keep module order.
    taken = {path: take(f"{path}.", module) for path, module, _ in sorted(found, key=lambda f: -f[2])}
    for path, module, _ in found:
        if taken[path]:
            specs.append(UnitSpec(path, module, taken[path], frozen))
    root_params = take("", model)
    if root_params:
        specs.append(UnitSpec("", model, root_params, frozen))
    return specs
