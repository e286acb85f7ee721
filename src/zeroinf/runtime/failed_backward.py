"""A backward pass that raised midway: what the engine does when it is next entered.

[Note: a backward that raised]
A loop that skips a batch whose backward fails (`except torch.OutOfMemoryError: opt.zero_grad();
continue`, a bad sample, an error in a user's autograd.Function) goes on in plain PyTorch: the
partial gradients stay in `p.grad` until `zero_grad()`. The engine's end of backward is a callback
autograd runs only when the pass completes, so after a raise the engine used to stay "in
backward" for good: every later forward took the activation-recompute path, no later backward
began, and each `optimizer.step()` stopped with "optimizer.step() after 0 backward passes", a
training loop that could never step again, for a reason the message did not name.

The engine now notices the unfinished pass wherever it is entered from outside autograd (a
forward of the model, `zero_grad`, a step, a `zeroinf.gathered` block, `zeroinf.save`): no
backward is running on this thread (`torch._C._current_graph_task_id() == -1`, what torch's own
checkpointing asks) yet its pass never ended. (An error in the end-of-backward callback itself, a
collective or a gradient write failing there, ends the pass at once the same way.) It then ends
the pass as far as it can: gathered units are released, the reach agreement settled, the gradient
pool closed, the optimizer's in-backward step wound down. The partial gradients stay, as in
PyTorch, until `zero_grad()` drops them; a backward or a step before that stops, naming the call
to make (PyTorch would silently add them into the next step).

The optimizer's part (optim/backward_step.py `_abandon_backward_step`): a speculative step inside
backward is undone (states and parameters as before the step), so skipping the batch trains
exactly as the plain loop does. A final step (no clipping, no fp16) that had already stepped units
cannot be undone: nothing of the old states was kept. The model is then partly updated, and every
`zero_grad`, `step` and `zeroinf.save` stops with an error saying so until `zeroinf.load` restores a
checkpoint; `offload.step_in_backward = false` makes a loop that retries failed backwards exact.
At world > 1 a backward that fails on some ranks only (one rank out of memory) leaves the others in
a collective until `collective_timeout_s`, as under DDP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zeroinf.engine import Engine

FAILED_BACKWARD = (
    "the last backward pass raised midway and left this step's gradients partly accumulated: call "
    "optimizer.zero_grad() (or model.zero_grad()) to drop them before the next backward or optimizer.step(), "
    "as after a failed backward in PyTorch"
)


def backward_running() -> bool:
    """Whether an autograd backward pass runs on this thread (a hook inside it asks)."""
    return bool(torch._C._current_graph_task_id() != -1)


def abandon(engine: Engine) -> None:
    """End the pass `engine` began and autograd never finished: [Note: a backward that raised]."""
    engine._in_backward = False
    engine.pass_writes.end_pass()
    if engine._input_gradient_pass is not None:  # a pass for the inputs' gradients: it holds no gradient
        engine._input_gradient_pass.release_all()
        engine._input_gradient_pass = None
        return
    try:  # every rank started it when its backward began; unsettled, its result is never read
        engine._settle_agreement()
    except Exception:  # noqa: BLE001 - a collective failing here failed the pass already, which is raised
        pass
    engine._agreement = None
    engine._reducing.clear()  # their collectives are waited for when zero_grad drops the gradients
    engine._step_in_this_backward = False
    for unit in engine.units:
        unit.end_backward()
    if engine.scheduler is not None:
        engine.scheduler.release_all()
    engine.grad_pool.close()
    engine.backward_failed = True
    if engine.backward_abandoned is not None:
        engine.backward_abandoned()
