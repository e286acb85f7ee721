"""Whether a sharded module's parameters are still the engine's: checked before each forward.

Plain-PyTorch habits replace what the engine trains, and would otherwise lose training silently:
- a conversion after `shard` (`model.to(torch.bfloat16)`, `.half()`, `.cuda()`) gives every
  parameter storage of its own: the engine would go on stepping its buffers while the model
  computes with copies that never change (stages 0-2), or fail on mixed dtypes (stage 3);
- a resize after `shard` (Hugging Face's `resize_token_embeddings`) swaps in a tensor of the new
  size, which the flat buffers and optimizer states cannot follow (at stage 3 the old rows were
  empty placeholders, with nothing to copy); it was reported as a conversion before.
- a `DistributedDataParallel` wrapper around the sharded model (`DDP(model)` out of habit) adds
  a second reducer: at stages 0-2 it all-reduced every gradient again beside the engine's, at
  stage 3 backward failed with "AddmmBackward0 returned an invalid gradient ... expected shape
  compatible with [0]" (its buckets hold the empty placeholders).
- an in-place write to a parameter between steps (below).
Each is refused with the fix. A conversion replaces every parameter, so one per unit stands for
its unit; a resize touches one or two, so every parameter's shape is compared (attribute reads).

[Note: in-place writes to a sharded model's parameters]
A parameter of a sharded model is a view the engine points at its buffers: the values it trains are
the shard on its tier and the fp32 master. A write through the parameter itself between steps
(`model.apply(init_fn)` after `shard`, WGAN's weight clipping, `p.copy_(...)`) reached only that
view: at stage 3 an empty placeholder (the write did nothing), at stages 0-2 the compute copy, which
the next step overwrote from the master. Measured on the WGAN loop, 3e-3 off the plain loop at
stages 0-1 and 1.0 at stage 3, without a word. Inside `zeroinf.gathered(..., modify=True)` the same
write lands everywhere. Every in-place operation on a tensor bumps its version counter, and the
engine never writes through the parameters (its gathers and updates write the flat buffer, whose
views set by `p.data = ...` count apart), so a parameter whose counter moved since the engine last
looked (after building, after each `gathered` block) was written by someone else: refused at the
next forward or save, naming the parameter and the fix, wherever the write would be lost. A unit
kept whole whose buffer is all the engine holds takes it as its values (`writes_reach_values`): a
frozen one (no master; a checkpoint's load writes them so), and one whose fp32 masters are its owned
range (stages 0-2 in fp32 with the states in the same memory, a resident stage-3 unit whose shard
is the master), as DDP takes such writes. What this cannot see: writes through
`p.data` (a tensor with a counter of its own, by PyTorch's design) and through views the user made
before `shard`; README says so. Nor writes the model's own code makes while it runs (`PassWrites`).
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zeroinf.partition.unit import ParamState, ShardedUnit


def resized_param(unit: ShardedUnit) -> str | None:
    """A parameter of `unit` whose shape something outside the engine changed, described; else None."""
    if unit.state not in (ParamState.SHARDED, ParamState.UNSHARDED):
        return None
    sharded = unit.state is ParamState.SHARDED
    for name, p, slot, empty in zip(
        unit.param_names, unit.params, unit.layout.slots, unit.placeholder_shapes, strict=True
    ):
        # sharded, the parameter is an empty placeholder (0, ..., 0) with its number of dimensions
        # (unit.py); a resize of a sharded layer reads that shape and leaves e.g. (140, 0)
        if p.shape != (empty if sharded else slot.shape):
            return f"parameter {name} has shape {tuple(p.shape)}, but the engine holds {tuple(slot.shape)}"
    return None


def replaced_param(unit: ShardedUnit) -> str | None:
    """A parameter of `unit` converted to another dtype or device by something outside the engine,
    described; else None. Each parameter of a unit is converted alike (`model.to`), so the first tells."""
    if not unit.params or unit.state not in (ParamState.SHARDED, ParamState.UNSHARDED):
        return None
    p, flat = unit.params[0], unit.param_flat
    if p.dtype == flat.dtype and p.device == flat.device:
        return None
    return (
        f"parameter {unit.param_names[0]} is a {p.dtype} tensor on {p.device} of its own, no longer the "
        f"engine's {flat.dtype} storage on {flat.device}"
    )


def reassigned_param(unit: ShardedUnit) -> str | None:
    """The name of a gathered parameter of `unit` that was given a tensor of its own (`p.data = t`,
    `module.weight.data = ...`), no longer a view of the unit's buffer; else None. Every parameter is
    checked, as `resized_param` checks every shape: one such parameter kept its value forever while
    the optimizer stepped the buffer (stages 0-2: a Linear of a layer frozen at what was assigned)."""
    if unit.state is not ParamState.UNSHARDED:
        return None
    off = unit.off_buffer()
    return unit.param_names[off[0]] if off else None


def writes_reach_values(unit: ShardedUnit) -> bool:
    """A write through `unit`'s parameters is a write of its values: the unit is kept whole and its
    whole buffer is what the engine holds: frozen (no master; its shard is, or aliases, the whole
    copy), or with fp32 masters that are its owned range (stages 0-2, `master_in_params`; a resident
    stage-3 unit whose shard is the master). A write to another rank's range is replaced by that
    rank's values at the next step's gather, as DDP's replicas must write alike."""
    whole = not (unit.policy.shard_params and not unit.resident)
    return whole and (unit.frozen or unit.master_in_params or unit.home_holds_master)


def written_in_place(unit: ShardedUnit) -> str | None:
    """The name of a parameter of `unit` written in place since its `remember_versions` where that
    write is lost (not `writes_reach_values`), or None."""
    if writes_reach_values(unit):
        return None
    return _first_written(unit)


def _first_written(unit: ShardedUnit) -> str | None:
    for name, p, seen in zip(unit.param_names, unit.params, unit.versions, strict=True):
        if p._version != seen:
            return name
    return None


class PassWrites:
    """The model's own code may bump version counters while it runs: peft's LoRA on a bare parameter
    (an MoE router, fused experts: `ParamWrapper`) registers a torch parametrization in every
    forward, and registering one `set_`s the parameter to itself, a version bump that writes
    nothing. Such bumps, during a forward or a backward (activation-checkpoint recomputes), are not
    the writes between steps this module refuses: the units whose counters were unchanged when the
    forward began take their counters again when it and its backward end. A unit already written
    then (inside a read-only `gathered` block) keeps its old counters, and is refused as before."""

    def __init__(self, units: list[ShardedUnit]) -> None:
        self.units = units
        self.clean: list[ShardedUnit] = []

    def begin_forward(self) -> None:
        self.clean = [unit for unit in self.units if _first_written(unit) is None]

    def end_pass(self) -> None:
        for unit in self.clean:
            unit.remember_versions()


def _refusal_of_write(unit: ShardedUnit) -> str | None:
    """The refusal for a parameter of `unit` written in place outside the engine, or None."""
    if unit.user_gathers > 0:  # a `gathered` block holds it: the block's end commits or refuses its writes
        return None
    name = written_in_place(unit)
    if name is None:
        return None
    lost = (
        "at stage 3 it reached an empty placeholder and did nothing"
        if unit.policy.shard_params and not unit.resident
        else "the engine's next step overwrites it from the fp32 master"
    )
    return (
        f"parameter {name} was written in place after zeroinf.shard, outside zeroinf.gathered (nn.init or "
        "model.apply(init_fn) on the sharded model, `with torch.no_grad(): p.clamp_(...)`, p.copy_(...)): the "
        f"values the engine trains are the shard on its tier and the fp32 master, not this view, so the write is "
        f"lost ({lost}). Write inside `with zeroinf.gathered(list(model.parameters()), modify=True):`, which lands "
        "the values in every rank's shard and master (model.load_state_dict(...) loads values the same way), or "
        "initialise before zeroinf.shard"
    )


def check_params_intact(units: list[ShardedUnit]) -> None:
    """Refuse, with the fix, a module whose parameters were resized, converted or written in place
    after `shard`."""
    for unit in units:
        written = _refusal_of_write(unit)
        if written is not None:
            raise RuntimeError(written)
        resized = resized_param(unit)
        if resized is not None:
            raise RuntimeError(
                f"{resized}: it was resized after zeroinf.shard (model.resize_token_embeddings, or a "
                "parameter replaced by one of another size), which the engine's flat buffers and optimizer "
                "states cannot follow; at stage 3 the old values were not even there to copy. Resize before "
                "zeroinf.shard (or inside the `with zeroinf.init()` block, after building; with "
                "zeroinf.from_pretrained, in prepare=)"
            )
        problem = replaced_param(unit)
        reassigned = reassigned_param(unit) if problem is None else None
        if reassigned is not None:
            raise RuntimeError(
                f"parameter {reassigned} was given a tensor of its own after zeroinf.shard (`p.data = t`): the engine "
                "trains the buffer it was a view of, so it would keep the assigned values forever while the optimizer "
                "steps the buffer. Write the values in place inside `with zeroinf.gathered([p], modify=True):` "
                "(p.copy_(t)), or assign before zeroinf.shard"
            )
        if problem is not None:
            raise RuntimeError(
                f"{problem}: the model was converted after zeroinf.shard (model.to(dtype or device), "
                ".half(), .bfloat16(), .cuda()), which replaces the parameters the engine trains; every "
                "step would leave them unchanged. Convert before zeroinf.shard, or not at all: "
                "Config.param_dtype sets the compute dtype, and each rank computes on its own device (for "
                "inference in another dtype, load model.state_dict() into a plain copy of the model)"
            )


def check_not_wrapped_in_ddp(module: nn.Module) -> None:
    """Refuse a forward of the sharded `module` run by a DistributedDataParallel wrapper (DDP marks
    the module whose forward it runs, for TorchDynamo)."""
    active = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if active is not None and getattr(active, "module", None) is module:
        raise RuntimeError(
            "the sharded model runs inside torch.nn.parallel.DistributedDataParallel: zeroinf reduces (and at "
            "stages 2-3 shards) the gradients itself, and DDP's reducer would all-reduce them a second time (at "
            "stage 3 its buckets hold empty placeholders). Use the model zeroinf.shard returned without the DDP "
            "wrapper; DDP's no_sync() and require_backward_grad_sync work on it directly"
        )
