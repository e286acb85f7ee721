"""Partition at construction: modules build on real memory and park their parameters; `shard` builds units.

    torch.manual_seed(0)
    with zeroinf.init(cfg):               # every module's own init code runs, as without it
        model = MyModel()                 # built parameters are parked: 1/world of each on the tier
    model = zeroinf.shard(model, cfg)     # unit by unit: unpark its parameters, build, shard

See [Note: construction is eager construction] in partition/park.py. Two PyTorch mechanisms and
nothing patched: the global parameter-registration hook adopts every parameter a module registers,
and a TorchFunctionMode (`ConstructionMode`) unparks parked parameters before any torch function
touches them. The values are therefore those of eager construction, bitwise, and memory while
building is the live budget plus the largest parameter being built, or, for a large fp32 one on the
CPU (an embedding), one 16 MB piece of it (park.py [Note: a large parameter drawn in pieces]).

`shard` then walks the units in module order and builds each one, unparking its parameters one at
a time straight into its flat buffer, so building holds one unit (and the root, which stays
unsharded at stage 3). A model built on the meta device by other means
(`with torch.device("meta")`) is materialized the old way: each module's parameters get storage
and its `reset_parameters()` runs (then `init_fn`); its buffers must already be real, since their
values cannot be recovered.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from zeroinf.config import Config
from zeroinf.memory import Tier
from zeroinf.partition import draw
from zeroinf.partition.park import KeptMaster, MemoryParkStore, ParamPark, ParkStore, Realize, swap_data
from zeroinf.partition.wrap import UnitSpec
from zeroinf.runtime import hooks as runtime_hooks
from zeroinf.tiers.host import map_large_buffers, return_freed_memory
from zeroinf.topology import Topology, default_topology
from zeroinf.weights.source import CheckpointWeights

InitFn = Callable[[nn.Module], None]
DEFAULT_LIVE_BYTES = 0  # built parameters are parked as soon as their module is attached

_T = torch.Tensor


def _descriptor(name: str) -> Any:
    """The class attribute `Tensor.<name>` of a tensor property: a C getset descriptor, whose `__get__`
    and `__set__` are what a TorchFunctionMode sees (the stubs type the attribute as its value)."""
    return getattr(_T, name)


def _tensor_functions(properties: str, methods: str) -> frozenset[Any]:
    """Tensor property getters and methods by name (those this torch version has)."""
    found: set[Any] = {getattr(_T, m) for m in methods.split() if hasattr(_T, m)}
    found |= {_descriptor(p).__get__ for p in properties.split() if hasattr(_T, p)}
    return frozenset(found)


# Answered by the meta placeholder itself: no need to bring the values back.
_METADATA = _tensor_functions(
    "shape dtype ndim requires_grad is_leaf grad grad_fn layout itemsize nbytes is_sparse is_quantized",
    "size dim numel nelement ndimension element_size is_floating_point is_complex __len__ __hash__ "
    "requires_grad_ stride is_contiguous",
) | {_descriptor("requires_grad").__set__}
# Answered with the parameter's real device (the placeholder is on meta).
_DEVICE_QUERIES: dict[Any, Callable[[torch.device], Any]] = {
    _descriptor("device").__get__: lambda d: d,
    _descriptor("is_meta").__get__: lambda d: d.type == "meta",
    _descriptor("is_cuda").__get__: lambda d: d.type == "cuda",
    _descriptor("is_cpu").__get__: lambda d: d.type == "cpu",
    _T.get_device: lambda d: d.index if d.type != "cpu" and d.index is not None else -1,
}

_DATA_GET = _descriptor("data").__get__

_active: list[ParamPark] = []  # parks of builds in progress or not yet sharded


def park_of(p: torch.Tensor) -> ParamPark | None:
    """The park holding `p`, if `zeroinf.init()` parked it."""
    return next((park for park in _active if park.holds(p)), None)


def deferring_park(p: torch.Tensor) -> ParamPark | None:
    """The park that built `p` without values (they come from files), if any."""
    return next((park for park in _active if park.defers(p)), None)


class ConstructionMode(TorchFunctionMode):
    """Unparks parked parameters before any torch function but a metadata read touches them; draws
    whole-overwriting initializations of large ones in pieces instead (park.py [Note: a large
    parameter drawn in pieces]), and remembers which large tensors are fresh `torch.empty`s."""

    def __init__(self, park: ParamPark) -> None:
        super().__init__()
        self.park = park
        # Storages of large CPU `torch.empty` results no torch function has touched since, held so
        # their memory (untouched, so not resident) cannot be reused by another tensor meanwhile.
        self.fresh: dict[int, torch.UntypedStorage] = {}

    def is_fresh(self, p: torch.Tensor) -> bool:
        """`p` is a whole fresh `torch.empty`: its values were never written. Forgets it either way."""
        with torch._C.DisableTorchFunction():  # asking is not a use
            storage = self.fresh.pop(p.untyped_storage().data_ptr(), None)
            return storage is not None and p.storage_offset() == 0 and storage.nbytes() == p.nbytes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        park = self.park
        if self.fresh and func not in _METADATA and func not in _DEVICE_QUERIES:  # any use but metadata
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                    self.fresh.pop(leaf.untyped_storage().data_ptr(), None)
        if park.parked and func not in _METADATA:
            drawn = draw.whole_overwrite(func, args, kwargs)
            if drawn is not None:
                target = park.behind_view(drawn[0])  # `p.data.normal_()` draws `p`
                if park.draws_on(target):
                    park.draw(target, drawn[1])
                    return_freed_memory()  # the pieces, as after a parking (see `evict`)
                    return drawn[0]
            if func == _DATA_GET and park.draws_on(args[0]):
                return park.data_view(args[0])  # stands for it until a torch function needs its values
        if func is torch.empty:
            out = func(*args, **kwargs)
            if out.device.type == "cpu" and out.nbytes >= draw.DRAW_MIN_BYTES:
                self.fresh[out.untyped_storage().data_ptr()] = out.untyped_storage()
            return out
        if (park.parked or park.deferred or park.data_views) and func not in _METADATA:
            query = _DEVICE_QUERIES.get(func)
            if query is not None:
                device = park.device_of(args[0])
                if device is not None:
                    return query(device)
            else:
                leaves = tree_leaves((args, kwargs))
                if park.deferred and park.fill_deferred is not None:
                    unknown = park.deferred_among(leaves)
                    if unknown:
                        park.fill(unknown)
                behind = park.views_among(leaves)
                touched = park.parked_among(leaves + behind)
                if touched:
                    park.unpark(touched)
                if behind:  # data views: the op runs on their parameters' data
                    args, kwargs = park.resolve_views((args, kwargs))  # type: ignore[misc]
                if touched or behind:
                    out = func(*args, **kwargs)
                    evict(park)
                    return out
        return func(*args, **kwargs)


def evict(park: ParamPark) -> None:
    """Park what exceeds the live budget, and give what that freed back to the OS at once: freed
    parameters below glibc's mmap threshold stay as heap otherwise, and the heap grew to 2.5x the
    park while a Llama was built (see return_freed_memory)."""
    parks = park.parks
    park.evict_over_budget()
    if park.parks != parks:
        return_freed_memory()


def _park_store(cfg: Config | None, topo: Topology) -> ParkStore:
    """The tier parked slices go to: the stage-3 parameter tier of `cfg`, else the device. Parameters on
    the host under a `max_host_bytes` with an `nvme_dir` may be split to NVMe (planner/unit_plan.py
    `_split_params`), which is known only once the model is built: they are parked on NVMe, so
    construction stays bounded whatever the split."""
    tier = Tier(cfg.offload.params) if cfg is not None and cfg.stage == 3 else Tier.DEVICE
    if tier is Tier.HOST and cfg is not None and cfg.offload.max_host_bytes is not None and cfg.offload.nvme_dir:
        tier = Tier.NVME
    if tier is Tier.NVME:
        from zeroinf.tiers.park_file import NvmeParkStore

        assert cfg is not None and cfg.offload.nvme_dir is not None  # OffloadConfig requires it
        return NvmeParkStore(cfg.offload.nvme_dir, topo.process_rank, cfg.offload.io_timeout_s)
    return MemoryParkStore(torch.device("cpu") if tier is Tier.HOST else topo.device)


@contextlib.contextmanager
def init(
    cfg: Config | Mapping[str, Any] | None = None, *, topology: Topology | None = None,
    live_bytes: int = DEFAULT_LIVE_BYTES, defer_values: bool = False, exact_masters: bool = False,
) -> Iterator[ParamPark]:
    """Build modules as usual, keeping only 1/world of each built parameter (in `cfg`'s compute
    dtype, on the tier it gives stage-3 parameters; without `cfg`, as built, on the device).

    A parameter is parked once its module is attached to a parent and more than `live_bytes` of
    such parameters are unparked (a cache for small models: 0 keeps memory lowest).

    Every rank must run the same construction code (unparking is a collective at world > 1).
    Leave the block before `zeroinf.shard(model, cfg)`; every parameter built in it is parked then.
    `defer_values`: keep no values at all (meta placeholders; `zeroinf.from_pretrained` reads them
    from files at `shard`); the park's `defer_values` may be switched off inside the block.
    `exact_masters`: park fp32 parameters in fp32 and keep, past `shard`, the values each rank's
    fp32 masters need until an optimizer takes them, so that a bf16/fp16 model trains exactly as if
    built eagerly (twice the park; partition/park.py [Note: exact masters under zeroinf.init]).
    """
    if any(park.collecting for park in _active):
        raise RuntimeError("zeroinf.init() is already active: build the whole model inside one `with` block")
    cfg = Config.of(cfg, "zeroinf.init") if cfg is not None else None
    if cfg is not None and cfg.is_auto:
        raise ValueError(
            "zeroinf.init(cfg): cfg has 'auto' placement fields, but the placement must be known before the "
            "model exists; choose it first: cfg = zeroinf.plan(<preset, HF folder or meta-device module>, cfg).config"
        )
    topo = topology or default_topology(cfg.collective_timeout_s if cfg is not None else 600.0)
    if cfg is not None:
        topo = topo.with_config(cfg)
    park_dtype = cfg.param_torch_dtype if cfg is not None and not exact_masters else None
    park = ParamPark(_park_store(cfg, topo), topo, live_bytes, park_dtype, defer_values, exact_masters)
    park.on_closed = lambda: release_park(park)
    _active.append(park)
    mode = ConstructionMode(park)

    guarded: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def adopt(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and park.can_draw(param) and mode.is_fresh(param):
            park.park_blank(param)  # its module's initialization will draw it in pieces
        else:
            park.adopt(param)
        if module not in guarded:
            guarded.add(module)
            park.built_modules.add(module)
            guards = runtime_hooks.register_load_hooks(module, _refuse_parked_load, None)
            _load_guards.setdefault(park, []).extend(guards)

    def settle(parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None:
            park.settle(child)
            evict(park)

    hooks = [
        torch.nn.modules.module.register_module_parameter_registration_hook(adopt),
        torch.nn.modules.module.register_module_module_registration_hook(settle),
    ]
    map_large_buffers()  # parked parameters' freed storage must go back to the OS, not stay as heap
    ok = False
    try:
        with torch.device(topo.device), mode:
            yield park
        ok = True
    finally:
        mode.fresh.clear()
        for hook in hooks:
            hook.remove()
        if ok:
            park.park_all()
            return_freed_memory()
        else:  # the build failed: nothing will be sharded from this park
            park.collecting = False
            park.close()
        release_park(park)


def release_park(park: ParamPark) -> None:
    """Forget a park once it has closed (everything in it unparked)."""
    if park.close_if_done() and park in _active:
        _active.remove(park)
        for handle in _load_guards.pop(park, []):
            handle.remove()


# The load guards of each park's modules, removed when it closes (the model is sharded by then).
_load_guards: dict[ParamPark, list[RemovableHandle]] = {}


def _refuse_parked_load(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any) -> None:
    """Before `module` loads its own values: after the `with zeroinf.init()` block and before
    `shard`, its parked (or deferred) parameters are meta placeholders, and PyTorch's copy into one
    is a no-op with only a warning: the weights would be silently lost. Inside the block the
    construction mode unparks them for the copy, so a load there works."""
    lost = [
        prefix + name for name, p in module._parameters.items()
        if p is not None and prefix + name in state_dict
        and any(not park.collecting and (park.holds(p) or park.defers(p)) for park in _active)
    ]
    if lost:
        more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
        raise RuntimeError(
            f"load_state_dict into a model built under zeroinf.init() and not sharded yet ({lost[0]}{more}): its "
            "parameters are parked, meta placeholders that PyTorch's copy would leave unchanged. Load after "
            "`model = zeroinf.shard(model, cfg)` "
            "(model.load_state_dict then loads unit by unit), inside the `with zeroinf.init()` block, or "
            "from files with zeroinf.from_pretrained / zeroinf.load_weights"
        )


def needs_materializing(module: nn.Module) -> bool:
    """True when some parameter is parked (built under zeroinf.init) or on the meta device."""
    return any(t.is_meta or park_of(t) is not None for t in module.parameters())


def _materialize_meta(module: nn.Module, device: torch.device) -> bool:
    """Give this module's own meta parameters (not parked ones) real storage; True if any was."""
    fresh = False
    for p in module._parameters.values():
        if p is not None and p.is_meta and park_of(p) is None and deferring_park(p) is None:
            real = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, real)
            fresh = True
    return fresh


def refuse_changes_after_the_block(model: nn.Module) -> None:
    """Refuse what code did to a model built under `zeroinf.init()` between its block and `shard`,
    where its parameters are parked meta placeholders and the change was lost, silently:
    - an in-place write (`nn.init.normal_`, `model.apply(init_fn)`, `p.fill_` under no_grad) reached
      the placeholder and did nothing; a conversion (`model.half()`) changed only its dtype;
      `p.data = t` gave it other storage;
    - a parameter replaced: `module.to_empty()` (what PyTorch's error for `model.to(device)` on the
      placeholders suggests) gives every module built in the block new parameters of uninitialized
      memory, and left nothing parked, so shard trained on that memory;
    - new parameters on meta: code that places new modules beside their neighbours (peft's
      `get_peft_model` moves each adapter to its base layer's device) moved real values to meta, and
      `reset_parameters` would stand in for them (measured: LoRA's zero-initialised B drawn as a
      Linear, the adapted model no longer the base model at step 0).
    A model built wholly on meta by other means has no parked parameter and is materialized as before."""
    for module_name, module in model.named_modules():
        for built_in in _active:
            replaced = built_in.replaced_after_block(module)
            if replaced is not None:
                raise RuntimeError(
                    f"parameter {module_name + '.' if module_name else ''}{replaced} was replaced after the "
                    "`with zeroinf.init()` block and before zeroinf.shard (`module.to_empty()`, which PyTorch's "
                    "error for `model.to(device)` there suggests, gives uninitialized memory; or a new "
                    "nn.Parameter assigned): between the block and shard the parameters are parked, and shard "
                    "places them on Config's tiers itself. Leave them as the block left them: set a parameter "
                    "inside the block, or after zeroinf.shard inside `with zeroinf.gathered([param], "
                    "modify=True):`"
                )
    lost, built_under_init = [], False
    for name, p in model.named_parameters():
        park = park_of(p)
        change = park.change_since_parked(p) if park is not None else None
        if change is not None:
            raise RuntimeError(
                f"parameter {name} was {change} after the `with zeroinf.init()` block and before zeroinf.shard: there "
                "it is a parked meta placeholder, so the change did nothing to its values. Make it inside the block "
                "(the values come back for it: the same result as without zeroinf), or after zeroinf.shard inside "
                "`with zeroinf.gathered(list(model.parameters()), modify=True):`; the compute dtype is "
                "Config.param_dtype"
            )
        if park is not None or deferring_park(p) is not None:
            built_under_init = True
        elif p.is_meta:
            lost.append(name)
    if lost and built_under_init:
        more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
        raise RuntimeError(
            f"parameter {lost[0]}{more} is on the meta device, but was not built inside the `with zeroinf.init()` "
            "block this model was built in: between the block and zeroinf.shard the parameters are parked meta "
            "placeholders, so code that puts new modules on their neighbours' device (peft's get_peft_model) put "
            "these on meta, and their values are lost. Add them inside the block (`with zeroinf.init(cfg): model = "
            "...; model = get_peft_model(model, lora)`, the same values as without zeroinf; a Trainer's peft_config= "
            "then stays unset), or with zeroinf.from_pretrained in prepare="
        )


def _check_buffers_real(model: nn.Module) -> None:
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(
            f"buffers {meta[:5]} are on the meta device: their values were never computed and cannot be "
            "recovered. Build the model under `zeroinf.init()` (which runs each module's own code on real "
            "memory) instead of `torch.device('meta')`, or set those buffers in init_fn"
        )


def _forget_deferred(params: list[nn.Parameter]) -> None:
    for p in params:
        park = deferring_park(p)
        if park is not None:
            park.take_deferred(p)


def _load_deferred(params: list[nn.Parameter], weights: CheckpointWeights | None) -> None:
    """Whole values from `weights` for deferred parameters outside units (every rank reads them)."""
    for p in dict.fromkeys(params):
        park = deferring_park(p)
        if park is None:
            continue
        stored = weights.stored(p) if weights is not None else None
        if stored is None:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} was built without values (zeroinf.from_pretrained) and "
                "no weights file holds it"
            )
        device = park.take_deferred(p)
        assert weights is not None
        swap_data(p, weights.folder.read(stored).to(device=device, dtype=p.dtype))


def _unpark(params: list[nn.Parameter], as_parked: bool = False) -> None:
    """Unpark parked parameters, park by park, in the given order (a collective at world > 1)."""
    by_park: dict[int, tuple[ParamPark, list[nn.Parameter]]] = {}
    for p in params:
        park = park_of(p)
        if park is not None:
            by_park.setdefault(id(park), (park, []))[1].append(p)
    for park, ps in by_park.values():
        park.unpark(ps, as_parked=as_parked)
        release_park(park)


def _unpark_into(
    p: nn.Parameter, dest: torch.Tensor, keep: tuple[int, int] | None = None
) -> tuple[bool, KeptMaster | None]:
    """A parked parameter's values straight into `dest` (its range of a unit's flat buffer): True,
    and the fp32 values of elements `keep` when its park keeps them for the masters
    (`ParamPark.unpark_into`); False when `p` is not parked (it holds its values)."""
    park = park_of(p)
    if park is None:
        return False, None
    kept = park.unpark_into(p, dest, keep)
    release_park(park)
    return True, kept


def materialize_and_build(
    model: nn.Module,
    specs: list[UnitSpec],
    build_unit: Callable[[UnitSpec, Realize], object],
    device: torch.device,
    init_fn: InitFn | None = None,
    weights: CheckpointWeights | None = None,
) -> list[object]:
    """Build each unit right after its last module, its parameters unparked one at a time straight
    into the unit's flat buffer (parameters built without values are read from `weights` by the unit
    itself).

    Meta parameters (a model built on `torch.device("meta")`) get storage and `reset_parameters()`
    module by module in registration order (so random numbers are drawn in a plain build's order);
    `init_fn` runs on every module owning parameters while they are real.
    """
    spec_of_param = {id(p): k for k, spec in enumerate(specs) for _, p in spec.params}
    modules = list(model.named_modules())
    last_module_of_spec: dict[int, int] = {}
    for mi, (_, m) in enumerate(modules):
        for p in m.parameters(recurse=False):
            if id(p) in spec_of_param:
                last_module_of_spec[spec_of_param[id(p)]] = mi
    ready_at: dict[int, list[int]] = {}
    for k, mi in last_module_of_spec.items():
        ready_at.setdefault(mi, []).append(k)
    if init_fn is None:  # fail before building anything (init_fn may still set meta buffers)
        _check_buffers_real(model)
    built: list[object | None] = [None] * len(specs)
    for mi, (_, m) in enumerate(modules):
        if _materialize_meta(m, device):
            with torch.no_grad():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
        if init_fn is not None and any(True for _ in m.parameters(recurse=False)):
            _unpark(list(m.parameters(recurse=False)))
            with torch.no_grad():
                init_fn(m)
        for k in sorted(ready_at.get(mi, [])):
            params = [p for _, p in specs[k].params]
            if weights is not None and weights.covers(params):  # built from the files: values unused
                _unpark(params, as_parked=True)
            built[k] = build_unit(specs[k], _unpark_into)
            _forget_deferred(params)
            return_freed_memory()
    # Parameters outside every unit (frozen ones below stage 3) take their values too.
    _unpark(list(model.parameters()))
    _load_deferred(list(model.parameters()), weights)
    for park in list(_active):
        if not park.collecting:
            park.forget_unreachable()
            release_park(park)
    _check_buffers_real(model)
    missing = [specs[k].name for k, u in enumerate(built) if u is None]
    if missing:
        raise RuntimeError(f"zeroinf.init: units {missing} were never materialized (internal error)")
    return built
