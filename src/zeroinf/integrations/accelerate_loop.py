"""A user's own accelerate loop: gradient accumulation, and `save_state` of sharded states.

    with accelerator.accumulate(model):
        loss = model(batch).loss
        accelerator.backward(loss)       # divides the loss by gradient_accumulation_steps
        optimizer.step(); optimizer.zero_grad()

accelerate gates `step()` and `zero_grad()` through its `AcceleratedOptimizer` wrapper: on a batch
that is not the last of an accumulation they do nothing. `accelerator.prepare` hands `zeroinf.AdamW`
back unwrapped (integrations/trainer.py [Note: accelerate and the sharded model]), so the sharded
optimizer reads the same switch, accelerate's `GradientState`, itself. Read from `sys.modules`
only: a run that never imported accelerate pays nothing and needs nothing installed.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from types import FrameType
from typing import Any


class AccelerateAccumulationError(ValueError):
    """accelerate accumulates over a different number of batches than `Config.grad_accum_steps`."""


def accelerate_defers_step(grad_accum_steps: int) -> bool:
    """True on a batch inside `accelerator.accumulate(model)` that is not the last of its
    accumulation: `step()` and `zero_grad()` then do nothing, as accelerate's own wrapper does.
    Raises when accelerate accumulates over another number of batches than the engine counts."""
    state_module = sys.modules.get("accelerate.state")
    if state_module is None:
        return False
    gradient_state_class = getattr(state_module, "GradientState", None)
    if gradient_state_class is None or not getattr(gradient_state_class, "_shared_state", None):
        return False  # no Accelerator in this process
    state = gradient_state_class()
    num_steps = int(getattr(state, "num_steps", 1))
    if num_steps > 1 and num_steps != grad_accum_steps:
        raise AccelerateAccumulationError(
            f"Accelerator(gradient_accumulation_steps={num_steps}) but the sharded model's Config.grad_accum_steps "
            f"is {grad_accum_steps}: set grad_accum_steps={num_steps} in the zeroinf Config (the engine counts the "
            "backward passes of a step itself, and reduces gradients only on the last one)"
        )
    return not bool(getattr(state, "sync_gradients", True))


# [Note: accelerate's save_state of sharded states]
# `accelerator.save_state(folder)` calls every prepared optimizer's `state_dict()` on every rank and
# writes rank 0's alone (optimizer.bin); `load_state` gives that file to every rank's
# `load_state_dict`. accelerate handles FSDP and DeepSpeed, whose states are sharded too, by calling
# their own savers; a zeroinf optimizer is handed back unwrapped (integrations/trainer.py [Note:
# accelerate and the sharded model]) and gets the plain path, so at world > 1 the file held rank 0's
# shard only: the other ranks' states were lost at save, found only at load (refused). accelerate
# offers no hook that sees the optimizer. So `state_dict()` asks who called it: accelerate's
# `save_accelerator_state` gets the whole state in torch.optim's format (optim/torch_format.py)
# gathered on rank 0, the others a dict that names rank 0 (they are not written, unless with
# save_on_each_node on other machines, which a load then refuses naming the fix), with the fp32
# masters, the step count and the loss scaler under "zeroinf", where torch.optim ignores them. What
# that buys: `load_state` at any world size, stage and placement (the file is indexed by parameter,
# not by shard), bitwise where the world is the same; a plain accelerate run (DDP, one GPU) resumes
# the file, and a zeroinf run resumes a plain run's. The price is FSDP's full state dict's: rank 0's
# host holds the whole state (16 bytes per parameter with Adam: refused up front, naming
# zeroinf.save, where it cannot fit) and accelerate's load gives the whole file to every rank
# (`load_kwargs={"mmap": True}` maps it: each rank reads the pages of its own pieces); above that,
# `zeroinf.save`/`zeroinf.load` write and read every rank's piece, and `sharded_save_state(accelerator)`
# makes `save_state`/`load_state` use them: a save pre-hook writes each zeroinf optimizer's state with
# zeroinf.save into a folder beside accelerate's files (every rank its piece, as DeepSpeed's engine
# saves under accelerate), the optimizer's file then holds only that folder's name, and `load_state`
# loads it with zeroinf.load once accelerate has loaded the weights (any world size, stage and
# placement; the masters exact). Any other caller of `state_dict()` still gets this rank's shard (one
# file per rank, the same world and stage).
def accelerate_saves_state() -> bool:
    """Whether the first caller outside zeroinf is accelerate's `save_state` writing the optimizers
    ([Note: accelerate's save_state of sharded states]). Called from `state_dict()`."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("zeroinf."):
        frame = frame.f_back  # state_dict itself and its decorators
    return frame is not None and frame.f_globals.get("__name__") == "accelerate.checkpointing"


SHARDED_KEY = "zeroinf_sharded_state"  # the optimizer file's one key: the folder zeroinf.save wrote
_to_save: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # optimizer -> its folder's name
_load_dirs: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # optimizer -> load_state's folder


def sharded_save_state(accelerator: Any) -> None:
    """Make `accelerator.save_state` / `load_state` write and read each zeroinf optimizer's state
    sharded, every rank its own piece, with zeroinf.save / zeroinf.load (any world size at load),
    instead of whole on rank 0 ([Note: accelerate's save_state of sharded states]): for states that
    one host cannot hold. Call once, after `accelerator.prepare` (again: nothing more)."""
    if getattr(accelerator, "_zeroinf_sharded_state", False):
        return
    accelerator._zeroinf_sharded_state = True
    accelerator.register_save_state_pre_hook(functools.partial(_save_sharded, accelerator))
    accelerator.register_load_state_pre_hook(_remember_load_dir)


def _optimizers_of(models: list[Any]) -> list[tuple[int, Any, Any]]:
    """(index, model, its current zeroinf optimizer) of the prepared models that are sharded."""
    from zeroinf.engine import sharded_engine

    found = []
    for index, model in enumerate(models):
        engine = sharded_engine(model)
        optimizer = engine.optimizer_ref() if engine is not None and engine.optimizer_ref is not None else None
        if optimizer is not None:
            found.append((index, model, optimizer))
    return found


def _save_sharded(accelerator: Any, models: list[Any], weights: list[Any], output_dir: str) -> None:
    """The pre-hook: zeroinf.save of each optimizer; node-local where accelerate saves on each
    machine (`ProjectConfiguration(save_on_each_node=True)`: checkpoint/saving.py [Note: node-local
    checkpoints])."""
    import zeroinf

    config = getattr(accelerator, "project_configuration", None)
    each_node = bool(getattr(config, "save_on_each_node", False))
    for index, model, optimizer in _optimizers_of(models):
        name = f"zeroinf_optimizer_{index}"
        zeroinf.save(os.path.join(output_dir, name), model, optimizer, step=optimizer.step_count, node_local=each_node)
        _to_save[optimizer] = name


def _remember_load_dir(models: list[Any], input_dir: str) -> None:
    for _, _, optimizer in _optimizers_of(models):
        _load_dirs[optimizer] = str(input_dir)


def sharded_state_dict(optimizer: Any) -> dict[str, str] | None:
    """What `state_dict()` returns to accelerate's `save_state` right after `sharded_save_state`'s hook
    saved this optimizer: the folder's name (accelerate writes it as the optimizer's file); None otherwise."""
    name = _to_save.pop(optimizer, None)
    return None if name is None else {SHARDED_KEY: name}


def load_sharded_state(optimizer: Any, state: dict[str, Any]) -> None:
    """`load_state_dict` of such a dict: zeroinf.load of the folder it names, inside `load_state`'s folder."""
    import zeroinf

    folder = _load_dirs.pop(optimizer, None)
    if folder is None:
        raise ValueError(
            f"this optimizer state names the folder {state[SHARDED_KEY]!r} that accelerate's save_state wrote with "
            "zeroinf.integrations.sharded_save_state: load it with accelerator.load_state after calling "
            "sharded_save_state(accelerator), or with zeroinf.load(os.path.join(checkpoint, that folder), model, "
            "optimizer)"
        )
    zeroinf.load(os.path.join(folder, state[SHARDED_KEY]), optimizer.engine.module, optimizer, load_rng=False)
