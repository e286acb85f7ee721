"""The parameter park: where `zeroinf.init()` keeps a built parameter until `zeroinf.shard` needs it.

[Note: construction is eager construction]
Under `zeroinf.init()` every module's own code runs on real memory, exactly as it would without
it: `torch.ones` norms, `randn` drawn in `__init__`, `reset_parameters`, buffers computed from
the config, Hugging Face's `post_init`. So the values are the eager values, bitwise, and draw the
same random numbers in the same order. What keeps memory bounded is the park: once the bytes of
built parameters exceed the live budget, the oldest are *parked*: this rank keeps 1/world of the
parameter's values (flattened, padded to a multiple of the world size) on the park's tier (device,
host or an NVMe file) and the parameter becomes a meta tensor of the same shape and dtype (the same
object: `torch.utils.swap_tensors`, so tied parameters stay tied and modules keep their attributes).

Nothing has to know when a module's construction is complete: code that touches a parked
parameter later (a parent module's init loop, `post_init`, `tie_weights`, weight surgery) runs under
the construction mode (partition/init.py), which unparks every parked parameter among the
arguments of any torch function before it runs, all-gathering the slices back. Parking early costs
a round trip, never a wrong value. Metadata reads (shape, dtype, requires_grad) are answered by the
meta tensor; device queries by the parameter's real device, so construction code that places new
tensors `on weight.device` keeps working.

A parameter is parked only when nothing else holds its storage (the use count; a view handed out
earlier may still be written through) and nothing else holds the tensor itself (an autograd graph
that used it: a parametrization's computed weight read while building, `weight_norm`); such a
parameter is parked later, once that is gone, or at the end of the block. At world > 1 that
decision is agreed by all ranks (one tiny all-reduce) because unparking is a collective: every
rank must unpark the same parameters in the same order, which identical construction code on every
rank guarantees.

[Note: parking in the compute dtype]
Given a `Config`, slices are parked in its `param_dtype` (bf16 halves the park). That loses
nothing against eager construction followed by `shard`, which rounds every parameter to that dtype
too, as long as code that touches a parked parameter overwrites it (init functions, `copy_`,
`fill_`): unparking gives back the rounded values, and rounding them again is exact. A
read-modify-write of a parked parameter in arithmetic (`weight.mul_(0.7)` in a parent's
`__init__`) computes on rounded inputs and may then differ from eager in the last bit of the
compute dtype. fp32 runs, and parameters touched before their module is attached, are exact.
What is not the same is the optimizer's start: eager construction followed by `shard` keeps each
trainable unit's owned range in fp32 until an optimizer takes it as its masters (unit.py
`initial_master`), so the masters start unrounded; built from the park, they are the parked values
widened, eager's rounded to the compute dtype (tests/partition/test_construction.py checks both).
The gathered `state_dict`, the buffers and the forward are eager's bit for bit; the updates differ
from the first step on, by the rounding of the initial weights (at most 2^-9 of each in bf16).
Unrounded masters come from loading fp32 values (`zeroinf.from_pretrained` reads them from the
files in fp32, `model.load_state_dict(fp32_state)` after `shard` sets them unrounded), or from
asking the park to keep them (next Note).

[Note: exact masters under zeroinf.init]
`zeroinf.init(cfg, exact_masters=True)` parks fp32 parameters in fp32 and keeps, past `shard`, the
fp32 values each rank's masters will hold, until an optimizer takes them: the masters start from
eager's unrounded values and a bf16/fp16 model then trains as the eagerly built one, bit for bit
(tests/partition/test_construction.py, world 1-3, every tier). When `shard` builds a unit, each
parked parameter is read into the unit's compute-dtype buffer as before (so building holds what it
did) and `unpark_into` keeps the elements this rank's master holds (`keep`): at world 1 the parked
slice itself (a master holds whole parameters), at world > 1 the owned part of the gathered
parameter written back under a key of its own. The unit's `_master_source` then starts the master
from its shard and writes the kept values over it (`ShardedUnit._exact_master`; an edit through
`gathered` before the optimizer lands over them), which frees them; the park closes (its NVMe file
removed) after the last, or when a unit is dropped before any optimizer took its master. The cost
is the memory the default saves: twice the park while building (4 bytes per parameter per rank
instead of 2, on the parameter tier), and those 4 bytes held past `shard` until the optimizer
exists, beside the compute-dtype shards. Measured on a 1.1B Llama with the park on NVMe
(benchmarks/init_memory.py, variant init_exact): the same host peak (175 against 183 MB above the
process), 4.4 instead of 2.2 GB written to the park, 1.12x the build time. Not the default for
that reason, and because DeepSpeed's `zero.Init` also starts from the rounded weights; at world > 1
gathering a parameter in fp32 holds it whole once in fp32 (twice the bf16 default) while its unit
is built.

[Note: a large parameter drawn in pieces]
Eager construction draws a 32000 x 2048 fp32 embedding whole (262 MB) in its own `__init__`, and
`post_init` draws it again; parked in bf16 it is 131 MB, and a Llama block 88 MB: that one
parameter was the peak of building a 1.1B Llama (330 MB above the process). So a large fp32
parameter built on the CPU from `torch.empty` (the construction mode saw the empty tensor made, and
nothing write it, partition/init.py) is parked *blank* when its module registers it: no values, no
slot written. An initialization that overwrites it whole (`normal_`, `uniform_`,
`kaiming_uniform_`, fills: partition/draw.py) is then run piece by piece, 4M elements at a time,
each piece drawn in the parameter's dtype, cut to this rank's slice, converted and written to the
store: the same numbers as the whole draw, bitwise, because the CPU generator's stream does not
depend on where a normal_ or uniform_ is cut at multiples of 16 elements (measured, generator
state after the draw included; not so on CUDA, where the draw is whole as before). Every rank
draws every piece, so the generator advances as in eager construction. Anything else that touches
a blank parameter unparks it as zeros (eager construction would show uninitialized memory). Any
parked fp32 CPU parameter that such an initialization overwrites (`post_init` on a parked block)
is drawn the same way: no read of values about to be replaced, no round trip. So is one through
`.data` (`weight.data.normal_(mean=0.0, std=0.02)`, Hugging Face v4's and many remote-code models'
init): `p.data` of such a parked parameter is a meta tensor standing for it (`data_view`), which any
other torch function resolves to `p`'s real data, unparked (`weight.data[pad].zero_()`).

`zeroinf.shard` builds each unit right after its last module (partition/init.py) and unparks its
parameters one at a time straight into the unit's flat buffer (at world 1 read from the NVMe park
chunk by chunk), so building needs one unit's buffer in memory and no second copy of any parameter;
the park closes (its NVMe file removed) when the last parameter has left it.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from zeroinf.comm import all_gather_into, all_reduce
from zeroinf.partition import draw as draw_module
from zeroinf.partition.draw import Fill, piece_bounds
from zeroinf.topology import Topology


class ParkStore(Protocol):
    """Where this rank's slices of parked parameters live; keys are small integers."""

    def put(self, key: int, values: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        """Store (or overwrite) a slice of `numel` elements in `dtype`: `values` (a view of the
        parameter, read during the call) then padding (any value: it is cut off when unparked)."""
        ...

    def put_pieces(self, key: int, pieces: Iterable[torch.Tensor], numel: int, dtype: torch.dtype) -> None:
        """`put` of values that arrive as consecutive flat pieces, each consumed in order."""
        ...

    def take(self, key: int, device: torch.device) -> torch.Tensor: ...  # the slice, as a fresh tensor

    def take_into(self, key: int, out: torch.Tensor, keep: bool = False) -> None:
        """The slice's first `out.numel()` elements, written into `out` (converted to its dtype);
        `keep`: the slice stays stored (read again later, then `discard`ed)."""
        ...

    def discard(self, key: int) -> None: ...  # a slice no longer needed (a no-op for an unknown key)

    def reading_only(self) -> None: ...  # the build is over: mostly reads from now on (fewer buffers)

    def close(self) -> None: ...


class MemoryParkStore:
    """Slices kept as tensors on one device (the accelerator, or the CPU for the host tier)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slices: dict[int, torch.Tensor] = {}

    def put(self, key: int, values: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        self.put_pieces(key, [values.reshape(-1)], numel, dtype)

    def put_pieces(self, key: int, pieces: Iterable[torch.Tensor], numel: int, dtype: torch.dtype) -> None:
        kept = self._slices.get(key)  # a slice drawn again is rewritten in place, not reallocated
        if kept is None or kept.numel() != numel or kept.dtype != dtype:
            kept = torch.empty(numel, dtype=dtype, device=self.device)
        at = 0
        for piece in pieces:
            kept[at : at + piece.numel()].copy_(piece)
            at += piece.numel()
        kept[at:].zero_()
        self._slices[key] = kept

    def take(self, key: int, device: torch.device) -> torch.Tensor:
        return self._slices.pop(key).to(device)

    def take_into(self, key: int, out: torch.Tensor, keep: bool = False) -> None:
        kept = self._slices[key] if keep else self._slices.pop(key)
        out.view(-1).copy_(kept[: out.numel()])

    def discard(self, key: int) -> None:
        self._slices.pop(key, None)

    def reading_only(self) -> None:
        pass

    def close(self) -> None:
        self._slices.clear()


@dataclass
class KeptMaster:
    """fp32 values of a parked parameter (this rank's part of its unit's master) kept past `shard`
    until an optimizer takes them ([Note: exact masters under zeroinf.init])."""

    park: ParamPark
    key: int
    numel: int

    def read_into(self, out: torch.Tensor) -> None:
        self.park.read_kept(self.key, out)

    def drop(self) -> None:
        self.park.drop_kept(self.key)


# A unit's builder writes each parameter into its range of the flat buffer (zeroinf.shard after
# zeroinf.init): (p, dest, elements of p this rank's master holds) -> (was p parked, its kept values).
Realize = Callable[[nn.Parameter, torch.Tensor, "tuple[int, int] | None"], "tuple[bool, KeptMaster | None]"]


@dataclass
class _Parked:
    """What the meta placeholder cannot tell: the real device, and this rank's slice."""

    key: int
    param: nn.Parameter  # a strong reference: a parked parameter stays reachable until unparked
    device: torch.device
    numel: int
    dtype: torch.dtype  # of the parked slice
    blank: bool = False  # parked before any value was written: no slot in the store yet (Note above)
    # The placeholder as parked: an in-place write to it bumps its version counter (and does nothing
    # to the values), a conversion (`model.half()`) changes its dtype; see `change_since_parked`.
    version: int = 0
    own_dtype: torch.dtype = torch.float32
    # ... and `p.data = t` replaces its storage: held, so its address stays its own
    storage: torch.UntypedStorage | None = None


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _refcount_held_once() -> int:
    """What `sys.getrefcount(holder.x)` gives for an object that only `holder` references. Measured,
    not assumed: the count includes the call's own references, which differ between Python versions
    (3.14 borrows some)."""
    holder = _Holder(object())
    return sys.getrefcount(holder.x)


@dataclass
class _Holder:
    x: object


def _storage_shared(p: torch.Tensor) -> bool:
    """True when another tensor (a view handed out earlier) shares the parameter's storage.

    The count includes the Python storage object made to ask, hence 2 for a sole owner.
    """
    return torch._C._storage_Use_Count(p.untyped_storage()._cdata) > 2


def _swappable(p: nn.Parameter) -> bool:
    """What `torch.utils.swap_tensors` requires: no weak reference pins the object, and nothing but its
    own gradient accumulator holds its TensorImpl. An autograd graph that used the parameter does
    (a weight computed from it by a parametrization, `weight_norm`, while that result lives): such a
    parameter is parked later, once the graph is gone, or stays whole."""
    if weakref.getweakrefcount(p):
        return False
    uses = p._use_count()  # type: ignore[attr-defined]  # what swap_tensors checks; not in the stubs
    if uses == 2 and p.is_leaf:
        edge = torch.autograd.graph.get_gradient_edge(p)  # the accumulator, created here if it was not
        uses = p._use_count()  # type: ignore[attr-defined]  # still 2: the accumulator was the other holder
        del edge
    return uses <= 2


def _parkable(p: nn.Parameter) -> bool:
    """No view shares its storage, and `swap_tensors` can give it new contents."""
    return not _storage_shared(p) and _swappable(p)


def swap_data(p: nn.Parameter, data: torch.Tensor) -> None:
    """Give `p` new contents in place (also across devices, e.g. to and from meta), keeping its
    identity, class, requires_grad and Python attributes (Hugging Face marks some)."""
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, new)


class ParamPark:
    """Parked parameters of one `zeroinf.init()` build, and the live ones it may park."""

    def __init__(
        self, store: ParkStore, topo: Topology, live_budget_bytes: int, park_dtype: torch.dtype | None = None,
        defer_values: bool = False, exact_masters: bool = False,
    ) -> None:
        if live_budget_bytes < 0:
            raise ValueError(f"zeroinf.init: live_bytes = {live_budget_bytes} must be >= 0")
        self.store, self.topo, self.live_budget_bytes = store, topo, live_budget_bytes
        self.park_dtype = park_dtype  # None: keep each parameter's own dtype
        # Keep the fp32 values a unit's masters need past `shard`, until an optimizer takes them
        # ([Note: exact masters under zeroinf.init]); store keys of such values not yet taken.
        self.exact_masters = exact_masters
        self.kept_keys: set[int] = set()
        self._next_kept_key = -1  # kept values get keys of their own, below the parameters'
        self.on_closed: Callable[[], None] | None = None  # told when the last kept values close the park
        # defer_values: parameters become meta placeholders as soon as they are registered, with no
        # values kept at all (they will be read from a checkpoint; see zeroinf.from_pretrained)
        self.defer_values = defer_values
        self.deferred: dict[int, tuple[nn.Parameter, torch.device]] = {}
        # The stored values of a deferred parameter, for code in the block that reads it (set by
        # zeroinf.from_pretrained around `prepare`: resize_token_embeddings copies the old rows).
        self.fill_deferred: Callable[[nn.Parameter], torch.Tensor] | None = None
        self.parked: dict[int, _Parked] = {}  # id(param) ->
        self.live: OrderedDict[int, nn.Parameter] = OrderedDict()  # built or unparked, oldest first
        self.settled: set[int] = set()  # live parameters whose module is attached to a parent: built
        self.collecting = True  # inside the `with zeroinf.init()` block: new parameters are adopted
        self.closed = False
        self._key_of: dict[int, int] = {}  # a parameter parked again reuses its slot
        # `p.data` of parked parameters that are drawn in pieces: meta tensors standing for them, so that
        # `p.data.normal_()` is drawn too ([Note: a large parameter drawn in pieces]). Weak on the view
        # (usually a temporary); the parameter is held, as a view of its data would hold its storage
        # (a weak reference would stop `swap_tensors`).
        self.data_views: WeakIdKeyDictionary = WeakIdKeyDictionary()  # view -> its parameter
        self.parks = self.unparks = self.draws = self.blanks = 0  # counters, for tests and the benchmark
        self.parked_bytes = 0  # bytes of slices written to the store
        # Modules that registered a parameter in the block, and the parameters the block's end could not
        # park (they stay whole): with those parked or deferred, every parameter such a module holds at
        # the block's end; `replaced_after_block` finds one given later (`to_empty`, a new Parameter).
        self.built_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.kept_whole: set[int] = set()

    # -- queries --------------------------------------------------------------------------------------
    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.parked

    def owns_slot(self, p: torch.Tensor) -> bool:
        """True when `p` was parked here at some point (it may be unparked now)."""
        return id(p) in self._key_of and not self.closed

    def device_of(self, p: torch.Tensor) -> torch.device | None:
        param = self.behind_view(p)
        if param is not p:  # a data view: its parameter's device, parked or not
            if id(param) not in self.parked:
                with torch._C.DisableTorchFunction():
                    return param.device
            p = param
        entry = self.parked.get(id(p))
        if entry is not None:
            return entry.device
        deferred = self.deferred.get(id(p))
        return deferred[1] if deferred is not None else None

    def defers(self, p: torch.Tensor) -> bool:
        return id(p) in self.deferred

    def replaced_after_block(self, module: nn.Module) -> str | None:
        """The name of a parameter of `module` (built in this park's block) that the block's end did not
        leave there: one given after it, or None."""
        if self.collecting or module not in self.built_modules:
            return None
        for name, p in module._parameters.items():
            if p is not None and not (self.holds(p) or self.defers(p) or id(p) in self.kept_whole):
                return name
        return None

    def take_deferred(self, p: torch.Tensor) -> torch.device:
        """Forget a deferred parameter (its values are being loaded); its real device."""
        return self.deferred.pop(id(p))[1]

    def deferred_among(self, tensors: Iterable[object]) -> list[nn.Parameter]:
        """The deferred parameters among `tensors`, each once, in order of appearance."""
        found: dict[int, nn.Parameter] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) in self.deferred:
                found.setdefault(id(t), self.deferred[id(t)][0])
        return list(found.values())

    def fill(self, params: list[nn.Parameter]) -> None:
        """Give deferred parameters that code reads their stored values (`fill_deferred`); from then
        on they are held like built ones (parked beyond the live budget, built from the park)."""
        assert self.fill_deferred is not None
        for p in params:
            values = self.fill_deferred(p)
            device = self.take_deferred(p)
            with torch.no_grad(), torch._C.DisableTorchFunction():
                swap_data(p, values.to(device=device, dtype=p.dtype))
            self.live[id(p)] = p
            self.settled.add(id(p))

    def parked_among(self, tensors: Iterable[object]) -> list[nn.Parameter]:
        """The parked parameters among `tensors`, each once, in order of appearance."""
        found: dict[int, nn.Parameter] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) in self.parked:
                found.setdefault(id(t), self.parked[id(t)].param)
        return list(found.values())

    # -- adopt / settle / evict -----------------------------------------------------------------------
    def adopt(self, p: nn.Parameter | None) -> None:
        """Track a parameter just registered on a module (its module may still be building)."""
        if (
            p is None or not self.collecting or type(p) is not nn.Parameter or p.is_meta
            or p.numel() == 0 or not p.is_floating_point() or id(p) in self.parked or id(p) in self.live
        ):
            return
        if self.defer_values:
            device = p.device
            with torch.no_grad(), torch._C.DisableTorchFunction():
                swap_data(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))  # `torch.empty`: no page touched
            self.deferred[id(p)] = (p, device)
            # transformers' init functions skip it, as they skip what its own loader loaded: drawing
            # a placeholder is wasted, and some draws (trunc_normal_'s rejection loop) need values
            p._is_hf_initialized = True  # type: ignore[attr-defined]
            return
        self.live[id(p)] = p

    def settle(self, module: nn.Module) -> None:
        """`module` was attached to a parent, so its `__init__` has returned: its parameters are built."""
        for p in module.parameters():
            if id(p) in self.live:
                self.settled.add(id(p))

    def evict_over_budget(self) -> None:
        """Park the oldest settled parameters beyond the live budget (those without aliases).

        Parameters of a module still building are never parked here: its own code is about to
        initialize them, and parking them would only cost a round trip.
        """
        settled = [p for key, p in self.live.items() if key in self.settled]
        total = sum(_nbytes(p) for p in settled)
        candidates = []
        for p in settled:
            if total <= self.live_budget_bytes:
                break
            candidates.append(p)
            total -= _nbytes(p)
        if not candidates:
            return
        flags = torch.tensor([int(_parkable(p)) for p in candidates], dtype=torch.int32, device=self.topo.device)
        if self.topo.is_distributed:  # parking decides later collectives: all ranks must agree
            all_reduce(flags, self.topo, async_op=False, what="which parameters zeroinf.init parks")
        for p, ok in zip(candidates, flags.tolist(), strict=True):
            if ok == self.topo.world_size:
                self.park(p)

    def park_all(self) -> None:
        """Park every live parameter (the end of the `with` block); stop adopting new ones."""
        for p in list(self.live.values()):
            if _swappable(p):
                self.park(p)
            else:
                self.kept_whole.add(id(p))
        self.live.clear()
        self.settled.clear()
        self.collecting = False
        self.store.reading_only()

    def park(self, p: nn.Parameter) -> None:
        """Keep this rank's slice of `p` in the store; `p` becomes a meta tensor of its shape."""
        self.live.pop(id(p), None)
        self.settled.discard(id(p))
        world, rank = self.topo.world_size, self.topo.rank
        numel = p.numel()
        per_rank = math.ceil(numel / world)
        with torch.no_grad(), torch._C.DisableTorchFunction():
            flat = p.detach().reshape(-1)
            piece = flat[min(rank * per_rank, numel) : min((rank + 1) * per_rank, numel)]
            dtype = self._slice_dtype(p)
            key = self._key_of.setdefault(id(p), len(self._key_of))
            self.store.put(key, piece, per_rank, dtype)
            self.parked_bytes += per_rank * dtype.itemsize
            device = p.device
            swap_data(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        self.parked[id(p)] = _Parked(
            key, p, device, numel, dtype, version=p._version, own_dtype=p.dtype, storage=p.untyped_storage()
        )
        self.parks += 1

    def _slice_dtype(self, p: torch.Tensor) -> torch.dtype:
        """`park_dtype` when narrower than the parameter's own: see [Note: parking in the compute dtype]."""
        if self.park_dtype is not None and p.dtype.itemsize > self.park_dtype.itemsize:
            return self.park_dtype
        return p.dtype

    # -- drawn in pieces ([Note: a large parameter drawn in pieces]) ---------------------------------
    def data_view(self, p: nn.Parameter) -> torch.Tensor:
        """`p.data` of a parked parameter: a meta tensor of its shape standing for it. An initialization
        that overwrites the view whole is drawn into `p`'s slot; anything else resolves the view to
        `p`'s real data (`resolve_views`)."""
        with torch._C.DisableTorchFunction():
            view = p.data
        self.data_views[view] = p
        return view

    def behind_view(self, t: torch.Tensor) -> torch.Tensor:
        """The parameter a data view stands for, else `t` itself."""
        param = self.data_views.get(t)
        return t if param is None else param

    def views_among(self, tensors: Iterable[object]) -> list[nn.Parameter]:
        """The parameters behind the data views among `tensors`."""
        return [self.data_views[t] for t in tensors if isinstance(t, torch.Tensor) and t in self.data_views]

    def resolve_views(self, tree: object) -> object:
        """`tree` with each data view replaced by its parameter's data, which must be unparked by now."""

        def real(t: object) -> object:
            if not isinstance(t, torch.Tensor) or t not in self.data_views:
                return t
            with torch._C.DisableTorchFunction():
                return self.data_views[t].data

        return tree_map(real, tree)

    def can_draw(self, p: nn.Parameter) -> bool:
        """Whether `p`, just registered, may be parked blank (its data is a fresh `torch.empty`)."""
        return (
            self.collecting and not self.defer_values and type(p) is nn.Parameter and p.dtype == torch.float32
            and p.device.type == "cpu" and _nbytes(p) >= draw_module.DRAW_MIN_BYTES
            and id(p) not in self.parked and id(p) not in self.live
        )

    def park_blank(self, p: nn.Parameter) -> None:
        """Park `p` with no values: a whole-overwriting initialization will `draw` them."""
        key = self._key_of.setdefault(id(p), len(self._key_of))
        device = p.device
        with torch.no_grad(), torch._C.DisableTorchFunction():
            swap_data(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        self.parked[id(p)] = _Parked(
            key, p, device, p.numel(), self._slice_dtype(p), blank=True, version=p._version, own_dtype=p.dtype,
            storage=p.untyped_storage(),
        )
        self.parks += 1
        self.blanks += 1

    def draws_on(self, p: torch.Tensor) -> bool:
        """Whether an initialization of parked `p` is drawn in pieces (fp32 on the CPU)."""
        entry = self.parked.get(id(p))
        return entry is not None and entry.device.type == "cpu" and p.dtype == torch.float32

    def draw(self, p: torch.Tensor, fill: Fill) -> None:
        """Run a whole-overwriting initialization of parked `p` piece by piece into the store: each
        piece filled by `fill` in `p`'s dtype, cut to this rank's slice, converted and written."""
        entry = self.parked[id(p)]
        numel, world, rank = entry.numel, self.topo.world_size, self.topo.rank
        per_rank = math.ceil(numel / world)
        low, high = min(rank * per_rank, numel), min((rank + 1) * per_rank, numel)

        def pieces() -> Iterator[torch.Tensor]:
            for start, end in piece_bounds(numel):  # every piece, on every rank: the generator advances alike
                with torch.no_grad(), torch._C.DisableTorchFunction():
                    piece = torch.empty(end - start, dtype=p.dtype, device=entry.device)
                    fill(piece)
                if max(start, low) < min(end, high):
                    yield piece[max(start, low) - start : min(end, high) - start]

        self.store.put_pieces(entry.key, pieces(), per_rank, entry.dtype)
        if entry.blank:
            self.parked_bytes += per_rank * entry.dtype.itemsize
        entry.blank = False
        self.draws += 1

    def unpark(self, params: list[nn.Parameter], *, as_parked: bool = False) -> None:
        """Give parked parameters their full values again (a collective at world > 1: every rank
        calls it with the same parameters in the same order). `as_parked`: in the dtype they were
        parked in (building a unit, which casts to the compute dtype anyway), not their own."""
        for p in params:
            entry = self._take_entry(p)
            with torch.no_grad(), torch._C.DisableTorchFunction():
                dtype = entry.dtype if as_parked else p.dtype
                if entry.blank:  # never written: zeros, on every rank alike (no collective)
                    values = torch.zeros(entry.numel, dtype=dtype, device=entry.device)
                elif self.topo.world_size == 1:  # read straight into the new storage (converted on the way)
                    values = torch.empty(entry.numel, dtype=dtype, device=entry.device)
                    self.store.take_into(entry.key, values)
                else:
                    values = self._gathered(entry).to(device=entry.device, dtype=dtype)
                swap_data(p, values.view(p.shape))
            self.unparks += 1
            if self.collecting:  # back to live, built: parked again once the touching op is done
                self.live[id(p)] = p
                self.settled.add(id(p))

    def unpark_into(
        self, p: nn.Parameter, dest: torch.Tensor, keep: tuple[int, int] | None = None
    ) -> KeptMaster | None:
        """Write a parked parameter's values straight into `dest` (flat, in its dtype: the parameter's
        range of its unit's flat buffer, which is being built); `p` is left holding no values (an
        empty tensor of `dest`'s dtype and device). A collective at world > 1, as `unpark`.

        `keep` (lo, hi): the elements of `p` this rank's fp32 master holds. With `exact_masters`,
        a slice parked in fp32 and written into a narrower `dest` keeps those values in the store
        for the optimizer (returned: [Note: exact masters under zeroinf.init])."""
        entry = self._take_entry(p)
        kept: KeptMaster | None = None
        retain = (
            self.exact_masters and keep is not None and keep[0] < keep[1] and not entry.blank
            and entry.dtype == torch.float32 and dest.dtype != torch.float32
        )
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if entry.blank:
                dest.zero_()
            elif self.topo.world_size == 1:
                # at world 1 a master holds whole parameters: the parked slice is the kept value
                whole = keep is not None and keep == (0, entry.numel)
                self.store.take_into(entry.key, dest, keep=retain and whole)
                if retain and whole:
                    kept = self._kept(entry.key, entry.numel)
                elif retain:
                    raise AssertionError(f"a master at world 1 holds whole parameters, not {keep} of {entry.numel}")
            else:
                full = self._gathered(entry)
                dest.copy_(full)
                if retain:
                    assert keep is not None
                    key = self._next_kept_key
                    self._next_kept_key -= 1
                    self.store.put(key, full[keep[0] : keep[1]], keep[1] - keep[0], torch.float32)
                    kept = self._kept(key, keep[1] - keep[0])
            swap_data(p, torch.empty((0,) * max(1, p.dim()), dtype=dest.dtype, device=dest.device))
        self.unparks += 1
        return kept

    def _kept(self, key: int, numel: int) -> KeptMaster:
        self.kept_keys.add(key)
        return KeptMaster(self, key, numel)

    def read_kept(self, key: int, out: torch.Tensor) -> None:
        """Kept fp32 values into `out` (a unit's master, on any device); then forgotten."""
        with torch.no_grad():
            if out.device.type == "cpu" and out.is_contiguous():
                self.store.take_into(key, out)
            else:
                out.copy_(self.store.take(key, out.device)[: out.numel()])
        self.drop_kept(key)

    def drop_kept(self, key: int) -> None:
        """Forget kept values (taken, or no optimizer will take them); the park closes after the last."""
        if key in self.kept_keys:
            self.kept_keys.discard(key)
            self.store.discard(key)
            if not self.collecting and self.close_if_done() and self.on_closed is not None:
                self.on_closed()

    def change_since_parked(self, p: nn.Parameter) -> str | None:
        """What code outside the construction mode did to parked `p`'s meta placeholder, described
        (an in-place write, a conversion: both lost on the placeholder), or None. Inside the block the
        mode brings the values back before any such operation, so the placeholder itself is untouched."""
        entry = self.parked.get(id(p))
        if entry is None:
            return None
        if p.dtype != entry.own_dtype:
            return f"converted from {entry.own_dtype} to {p.dtype}"
        if p._version != entry.version:
            return "written in place"
        if entry.storage is not None and p.untyped_storage()._cdata != entry.storage._cdata:
            return "given new data (`p.data = ...`)"
        return None

    def _take_entry(self, p: nn.Parameter) -> _Parked:
        entry = self.parked.pop(id(p))
        if p.numel() != entry.numel:
            raise RuntimeError(
                f"a parameter parked by zeroinf.init with {entry.numel} elements now has shape "
                f"{tuple(p.shape)}: it was changed outside `with zeroinf.init()`; change parameters inside "
                "the block, or after zeroinf.shard inside zeroinf.gathered(..., modify=True)"
            )
        return entry

    def _gathered(self, entry: _Parked) -> torch.Tensor:
        """The full flat values from every rank's slice (world > 1), in the parked dtype."""
        piece = self.store.take(entry.key, self.topo.device)
        full = torch.empty(piece.numel() * self.topo.world_size, dtype=piece.dtype, device=piece.device)
        all_gather_into(full, piece, self.topo, async_op=False, what="a parameter zeroinf.init parked")
        return full[: entry.numel]

    def forget_unreachable(self) -> None:
        """Drop parked parameters nothing but the park references (e.g. a head that `tie_weights`
        replaced): they can never be unparked, and would keep the park open. A parameter of another
        model built in the same block is referenced by its module, and stays."""
        alone = _refcount_held_once()
        for key, entry in list(self.parked.items()):
            if sys.getrefcount(entry.param) <= alone:
                del self.parked[key]
        for key in list(self.deferred):
            if sys.getrefcount(self.deferred[key][0]) <= alone:
                del self.deferred[key]

    def close_if_done(self) -> bool:
        """Close once the build is over and nothing is parked any more; True when closed."""
        if not self.collecting and not self.parked and not self.deferred and not self.kept_keys:
            self.close()
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.store.close()
