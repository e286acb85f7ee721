"""Gradient accumulation in a user's own accelerate loop.

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

import sys


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
