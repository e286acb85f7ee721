"""A second `zeroinf.AdamW` built for a model that already has one takes over its states.

[Note: a second optimizer for one model]
With torch.optim, building a new optimizer over the same parameters is how a loop starts afresh:
a second training phase with other hyperparameters or param groups, a notebook cell run again, an
LR range test that ends by building the real optimizer. zeroinf.AdamW used to refuse it ("one per
sharded model, for its whole life"), because the fp32 master weights live in the optimizer's
states: a new store would have started from the compute parameters, rounded in bf16, and the old
one, still referenced by the engine, kept its host memory or swap files for good.

So the new optimizer inherits the store, with what a fresh torch optimizer would have: the same
master weights (the exact values the model holds; in bf16, its unrounded masters), both moments zero
and every step count 0; its own hyperparameters and param groups (these only cut the store's ranges,
which stay whole). The fp16 loss scale carries over as well: it tracks the gradients' range, not the
optimizer, and a torch loop keeps its GradScaler when it builds a new optimizer. The moments are
zeroed unit by unit through `read_unit`/`write_unit`, which every tier has (one unit of memory
beyond the store; on NVMe, one read and one write of the states). The predecessor is retired: its
pending save is finished first, its hooks into the engine are removed, and any later use of it stops
naming the new one, never stepping states it no longer owns. Taking over needs a step boundary (no
backward waiting for `step()`) and consistent states (no step stopped midway); otherwise the new
optimizer is refused and the old one stays as it was.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from zeroinf.engine import Engine
from zeroinf.optim.nvme_states import NvmeStateStore
from zeroinf.optim.pipeline import StateViews
from zeroinf.optim.states import ResidentStateStore, SplitStateStore

Store = ResidentStateStore | NvmeStateStore | SplitStateStore

RETIRED = (
    "this zeroinf.AdamW was replaced by a newer one built for the same model, which took over its "
    "states (the fp32 master weights, moments reset): use the new optimizer "
    "(optim/succession.py [Note: a second optimizer for one model])"
)


def inherit_states(engine: Engine, moments: int = 2) -> Store | None:
    """The states of the model's previous zeroinf.AdamW, its moments zeroed, for a new one; None
    when the model has had none. Refuses (leaving the previous one as it was) off a step boundary."""
    if engine.optimizer_io is None:
        return None
    predecessor: Any = engine.optimizer_ref() if engine.optimizer_ref is not None else None
    store = cast(Store, engine.optimizer_io[0])  # what AdamW built (optim/states.py build_state_store)
    store.check_room_for(moments)  # before the predecessor gives anything up
    if predecessor is not None:
        predecessor.prepare_retirement()
    elif engine.micro_step:  # the previous optimizer is gone, its gradients are not
        raise RuntimeError(
            f"zeroinf.AdamW: the model holds the gradients of {engine.micro_step} backward pass(es) that no "
            "optimizer stepped: call model.zero_grad() (or finish the step) before building a new optimizer"
        )
    store.require_healthy()
    if predecessor is not None:
        predecessor.retire()
    engine.backward_step = engine.backward_prepare = None
    engine.backward_step_barrier = engine.backward_abandoned = None
    engine.transfers.wait_uploads()  # the last step's parameter uploads may still read the masters rewritten here
    store.keep_moments(moments)  # the new optimizer's state slots (optim/states.py ResidentStateStore)
    for ui in range(len(engine.units)):
        master = store.read_unit(ui).master
        store.write_unit(ui, StateViews(master, torch.zeros_like(master), torch.zeros_like(master)))
    return store
