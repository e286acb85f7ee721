"""Which unit parameters a backward reaches, on which ranks; and backwards that reach none.

[Note: gradients that reach some ranks only]
A unit's reduction starts when the last of its parameters' gradients arrives, and every rank must
issue its collectives in the same order. Where a parameter's gradient reaches some ranks only, that
order would differ: an expert of a mixture of experts (one module per expert) that no token on rank
1 was routed to, or a layer skipped on one rank (LayerDrop). Rank 0 would start the unit's
reduce-scatter inside backward while rank 1 waited for a gradient that never comes and reduced the
unit at the end, after its next units: a collective mismatch (gloo aborts the process; NCCL hangs
or mixes buffers of equal size). So at the start of each backward that communicates, every rank
asks autograd which unit parameters this pass reaches (exact: the engine knows the nodes reachable
from the loss; ~4 us a parameter) and one all-reduce sums that per parameter, and per unit the ranks
the unit reaches at all (`ReachAgreement`). Then, the same on every rank:
- a parameter some ranks reach and others not counts as arrived where it is not reached (it
  contributes zeros to the mean, as DDP's unused parameters do) and as having a gradient for the
  optimizer everywhere (a parameter no rank reaches is skipped by the step, as torch.optim skips a
  `None` gradient). Its unit reduces where its last reached gradient arrives, inside its own
  backward on every rank, so no other collective comes between;
- a unit that some ranks do not reach at all has no such point there: it reduces at the end of
  backward on every rank, with the units that never completed.
A parameter no rank reaches keeps the old behaviour (its unit waits for the end of backward, where
a second all-reduce agrees on what arrived): inside a reentrant checkpoint it is not reachable yet
but arrives later. The all-reduce runs while the backward of the first unit computes: its result is
first needed when a gradient arrives, so no rank waits for it at the start of backward.

[Note: a backward for the inputs' gradients]
`torch.autograd.grad(loss, x)` asks for the gradient of the inputs only: adversarial training (FGSM,
PGD) perturbs the inputs along it, a gradient penalty (WGAN-GP, R1) adds its norm to the loss
(`create_graph=True`). It runs the model's backward but delivers no gradient to any parameter. It
was counted as a micro-step ("backward pass 2 since the last optimizer step" at the training
backward after it), and at stage 3 it read released parameters. Such a pass (autograd reaches no
unit parameter: `hooks.reaches_any`) is no micro-step and reduces nothing; at stage 3 each unit is
gathered at its pre-backward and released two units later (the residual path may still need the
previous one), all of them at the end (`InputGradientPass`). With `create_graph=True` the gradient's
own graph reads the parameters once more in the training backward, before any unit of it is
gathered: refused at stage 3, where they are released by then; stages 0-2 keep them whole.
Two backwards that reach no unit parameter at their start are still training backwards:
- one whose parameters all run inside reentrant checkpoints (LoRA adapters in checkpointed layers,
  with the input made to need a gradient): autograd reaches them only in the backward each
  checkpoint runs of its own, later; `hooks.behind_reentrant_checkpoint` finds one below the node
  whose hook began the backward, the model's output (reentrant checkpoints refuse `autograd.grad`
  anyway);
- one that reaches none on this rank (its input needs a gradient, its loss no trainable parameter)
  but some on another: where the ranks communicate in this backward the kind is agreed, an
  input-gradient pass only if no rank reaches a parameter (`ReachAgreement.reached_anywhere`).
"""

from __future__ import annotations

import torch

from zeroinf.comm import Handle, all_reduce
from zeroinf.partition.unit import ShardedUnit
from zeroinf.runtime import hooks
from zeroinf.telemetry import CollectiveCounter
from zeroinf.topology import Topology


class ReachAgreement:
    """One backward's all-reduce of which unit parameters it reaches (module docstring). Started
    inside the backward; `settle()` waits for it and tells the units what to expect."""

    def __init__(self, units: list[ShardedUnit], topo: Topology, counter: CollectiveCounter) -> None:
        self.units, self.topo = units, topo
        self._reached = [hooks.reached_in_this_backward(unit.params) for unit in units]
        self._counts = torch.tensor(
            [int(r) for unit_reached in self._reached for r in unit_reached] + [int(any(r)) for r in self._reached],
            dtype=torch.int32, device=topo.device,
        )
        self._handle: Handle | None = all_reduce(self._counts, topo, what="which parameters this backward reaches")
        counter.add("all_reduce")
        self.reached_anywhere = True  # some rank's backward reaches a unit parameter
        self.every_parameter_reached = False  # which parameters get a gradient is agreed already

    def settle(self) -> None:
        if self._handle is None:
            return
        self._handle.wait()
        self._handle = None
        summed = self._counts.tolist()
        world, offset = self.topo.world_size, 0
        units_reached = summed[-len(self.units) :]
        self.reached_anywhere = any(units_reached)
        for unit, unit_reached, ranks_reaching in zip(self.units, self._reached, units_reached, strict=True):
            n = len(unit.params)
            unit.expect_gradients(unit_reached, summed[offset : offset + n], world)
            unit.reduce_at_end = 0 < ranks_reaching < world
            offset += n
        # Every parameter is reached somewhere: the end of backward needs no all-reduce of its own
        # (one all-reduce a step, as before this agreement existed).
        self.every_parameter_reached = 0 not in summed[:offset]


PENALTY_AT_STAGE_3 = (
    "torch.autograd.grad(..., create_graph=True) through a model at stage 3 (a gradient penalty such as "
    "WGAN-GP or R1): the penalty's graph reads the parameters again in the training backward, where stage 3 "
    "has released them. Use stage 2 for this model (its parameters stay whole on each rank; gradients and "
    "optimizer states are still sharded and offloaded)"
)


class InputGradientPass:
    """The stage-3 units a backward for the inputs' gradients gathered, released two units later."""

    LAG = 2

    def __init__(self) -> None:
        self.gathered: list[ShardedUnit] = []

    def gather(self, unit: ShardedUnit) -> None:
        unit.wait_unshard()
        if unit not in self.gathered:
            self.gathered.append(unit)
        while len(self.gathered) > self.LAG + 1:
            self._release(self.gathered.pop(0))

    def release_all(self) -> None:
        while self.gathered:
            self._release(self.gathered.pop(0))

    @staticmethod
    def _release(unit: ShardedUnit) -> None:
        if not unit.resident:
            unit.reshard()
