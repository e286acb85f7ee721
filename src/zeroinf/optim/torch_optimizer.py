"""zeroinf.ShardedOptimizer: any elementwise torch.optim optimizer over the shards a rank owns.

    opt = zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    opt = zeroinf.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # the same

[Note: a torch optimizer over shards]
FSDP2 takes any torch optimizer, and DeepSpeed's ZeRO wraps a "client optimizer" over its flat fp32
partitions. zeroinf does what DeepSpeed does, with the checks it leaves out: everything around the
update (sharded fp32 masters on their tier, the swap pipeline, clipping, fp16 scaling, the step inside
backward, checkpoints and resharding, `optimizer_state`) is optim/sharded.py's, and the update of a
staged sub-group is the torch optimizer's own `step()`, run on views: each run of one parameter
inside the sub-group becomes a 1-D tensor viewing the master (its `.grad` the gradient's piece), and
the optimizer's per-parameter states are views of the store's two state slots, handed over before
the step and taken back after it. So the arithmetic is torch's, and training matches the torch
optimizer on the unsharded model (tests/optim/test_torch_optimizer.py, stages 0-3 on every tier).

That holds only for an update that is elementwise: element i of the new parameter and states depends
only on element i of the old ones and of the gradient (SGD, Adagrad, RMSprop, Adadelta, Adamax,
RAdam, Rprop, Adam/AdamW, Lion). A rank steps its own piece of a parameter alone, and the piece is
flattened, so an update that reads the whole parameter (LAMB's and LARS's trust ratios, Adafactor's
relative step size and factored moments, Shampoo, Muon) would compute something else. The
constructor steps the optimizer on a small parameter whole and split in two, and flat and as a
matrix, and refuses it where the results differ, naming why; one that needs a closure (LBFGS) or
fails on a flat tensor (Muon takes only matrices: it orthogonalizes them whole) is refused too.
Its state must be at most two tensors shaped as the parameter (the store's slots) and `step`:
`NAdam` (a per-parameter `mu_product`), `ASGD` (`eta`, `mu`) and Adam with `amsgrad=True` (three
tensors) are refused with what they keep. Only the slots it keeps take memory or move to and from
NVMe (optim/states.py `absent_slot`, optim/nvme_states.py).

[Note: bf16 states of a torch optimizer]
With `offload.moment_dtype = "bf16"` the store keeps these states in bf16, as zeroinf.AdamW's
moments (optim/moments.py [Note: bf16 moments]): 2 bytes an element each (Lion's momentum beside
its fp32 master: 6 bytes per parameter instead of 8). The update runs window by window (at most
WINDOW_NUMEL elements of one parameter): each state widened to fp32, the torch optimizer's step,
then rounded back stochastically with the noise of (parameter name, element, step, state slot),
so every placement trains the same bits (tests: stage 3 on the host and on NVMe in small
sub-groups, stage 1 on the device), within bf16's rounding of fp32 states.

On a CPU each run is handed to the optimizer in windows of at most STEP_WINDOW_NUMEL elements,
each a piece of its own: an elementwise update gives the same bits, and the optimizer's passes over
a window (torch's single-tensor code makes two to four, some with a temporary) stay in cache. 100.7M
parameters (benchmarks/optimizer_tiers.py's model), host states, 2 threads, medians of 4 steps
alternating STEP_WINDOW_NUMEL = 2^40 (whole runs) and 2^20 in one process: SGD with
momentum 0.053 -> 0.047 s, Adagrad 0.074 -> 0.069, torch's AdamW (fused) and zeroinf.Lion (in blocks
already) unchanged.

A parameter's first step runs in a fresh instance of the optimizer built over its pieces, so the
optimizer creates its own initial state as it would (SGD's momentum is the first gradient,
Adagrad's sum starts at `initial_accumulator_value`, Rprop's step sizes at lr); later steps run in
one kept instance whose `state` is the store's views and whose `step` is the parameter's count.
States the optimizer replaced instead of updating in place are copied back into the slots.
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from zeroinf.engine import engine_of
from zeroinf.optim.moments import WINDOW_NUMEL, NoiseTable, param_key, round_stochastic_
from zeroinf.optim.pipeline import StateViews, SubGroup
from zeroinf.optim.sharded import ShardedOptimizerBase
from zeroinf.optim.torch_args import model_of_params

T = TypeVar("T")
MAX_STATES = 2  # tensors shaped as the parameter that the store keeps beside the master (exp_avg, exp_avg_sq)
STEP_WINDOW_NUMEL = WINDOW_NUMEL  # most elements one piece of a CPU step holds (see `_update_sub_group`)


class UnsupportedOptimizer(ValueError):
    """A torch optimizer whose update zeroinf cannot compute over shards; the message says why."""


def constructor_settings(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of an optimizer's `defaults` its constructor takes (torch's AdamW keeps
    `decoupled_weight_decay` among its defaults but does not take it)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


def _probe_lr(defaults: dict[str, Any]) -> dict[str, Any]:
    settings = dict(defaults)
    if "lr" in settings and not float(settings["lr"]):  # lr 0 (a warm-up's start) would hide a difference
        settings["lr"] = 1e-2
    return settings


def _run(cls: type[torch.optim.Optimizer], params: list[torch.Tensor], grads: list[list[torch.Tensor]],
         settings: dict[str, Any]) -> torch.optim.Optimizer:
    opt = cls(params, **settings)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return opt


def _on_a_flat_piece(cls: type[torch.optim.Optimizer], settings: dict[str, Any], run: Callable[[], T]) -> T:
    """`run()` (building or stepping `cls` over flat 1-D tensors, as zeroinf runs it on each rank's
    pieces of the parameters), its failure explained."""
    try:
        return run()
    except UnsupportedOptimizer:
        raise
    except Exception as err:
        if isinstance(err, TypeError) and "closure" in str(err):
            raise UnsupportedOptimizer(
                f"zeroinf.ShardedOptimizer: {cls.__name__}.step needs a closure (it re-evaluates the loss, as "
                "LBFGS does); zeroinf steps each rank's shard of the parameters once per step, without one"
            ) from err
        raise UnsupportedOptimizer(
            f"zeroinf.ShardedOptimizer: {cls.__name__} with {settings} fails on a flat 1-D tensor, the form in "
            f"which zeroinf steps each rank's piece of a parameter: {type(err).__name__}: {err}"
        ) from err


class Inspected(NamedTuple):
    names: tuple[str, ...]  # the per-parameter tensors it keeps, in the order it makes them
    keeps_step: bool  # whether its state holds a `step` (Adam's does, SGD's not)


def inspect_optimizer(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> Inspected:
    """The per-parameter states `cls` keeps (at most two tensors, and `step` or not), after checking
    that its update is elementwise and keeps nothing else ([Note: a torch optimizer over shards])."""
    name = cls.__name__
    settings = _probe_lr(defaults)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, generator=gen)
    x[:8] *= 50.0  # halves of very different size: a per-parameter norm or RMS differs between them
    grads = []
    for _ in range(3):
        g = torch.randn(16, generator=gen)
        g[8:] *= 0.01
        grads.append(g)
    whole = x.clone()
    halves = [x[:8].clone(), x[8:].clone()]
    matrix = x.clone().view(4, 4)
    one = _on_a_flat_piece(cls, settings, lambda: _run(cls, [whole], [[g] for g in grads], settings))
    _on_a_flat_piece(cls, settings, lambda: _run(cls, halves, [[g[:8], g[8:]] for g in grads], settings))
    try:
        _run(cls, [matrix], [[g.view(4, 4)] for g in grads], settings)
        stepped_as_matrix = True
    except Exception:  # it will only see flat pieces: refusing matrices is no concern
        stepped_as_matrix = False
    split = torch.cat(halves)
    if not torch.allclose(whole, split, rtol=1e-5, atol=1e-6):
        raise UnsupportedOptimizer(
            f"zeroinf.ShardedOptimizer: {name}'s update is not elementwise: a parameter stepped whole and in two "
            f"pieces ends differently (largest difference {float((whole - split).abs().max()):.3g}), as with "
            "per-parameter norms (LAMB, LARS), Adafactor's relative step size, Shampoo or Muon. zeroinf steps "
            "each rank's piece of a parameter alone, so it cannot compute this update; use an elementwise "
            "one (SGD, Adagrad, RMSprop, Adam, AdamW, Lion, ...)"
        )
    if stepped_as_matrix and not torch.allclose(whole, matrix.reshape(-1), rtol=1e-5, atol=1e-6):
        raise UnsupportedOptimizer(
            f"zeroinf.ShardedOptimizer: {name}'s update depends on the parameter's shape (a matrix and the same "
            "numbers flat end differently, as with factored moments); zeroinf steps flat pieces of parameters, "
            "so it cannot compute this update; use an elementwise optimizer (SGD, Adagrad, RMSprop, Adam, ...)"
        )
    names: list[str] = []
    others: list[str] = []
    for key, value in one.state[whole].items():
        if key == "step" or value is None:  # SGD without momentum keeps its buffer as None
            continue
        if isinstance(value, torch.Tensor) and value.shape == whole.shape and value.dtype == torch.float32:
            names.append(str(key))
        else:
            others.append(str(key))
    if others:
        raise UnsupportedOptimizer(
            f"zeroinf.ShardedOptimizer: {name} keeps per-parameter state {others} that is neither a tensor shaped "
            "as the parameter (fp32) nor `step`; zeroinf keeps a parameter's state as fp32 tensors sharded "
            "like it, so it cannot keep these"
        )
    if len(names) > MAX_STATES:
        raise UnsupportedOptimizer(
            f"zeroinf.ShardedOptimizer: {name} with these settings keeps {len(names)} tensors per parameter "
            f"({', '.join(names)}); zeroinf keeps at most {MAX_STATES} beside the fp32 master (Adam's moments' "
            "room). Choose settings that keep fewer (Adam without amsgrad, RMSprop without centered or momentum)"
        )
    return Inspected(tuple(names), "step" in one.state[whole])


class ShardedOptimizer(ShardedOptimizerBase):
    """A torch.optim optimizer (any subclass of torch.optim.Optimizer with an elementwise update) over a
    sharded model ([Note: a torch optimizer over shards]). Two forms, the same optimizer:

        zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
        zeroinf.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    The parameters (or param groups) are those torch.optim takes: every trainable parameter of one
    sharded model. `param_groups` hold the user's parameters and the optimizer's hyperparameters, so
    LR schedulers work unchanged. `track_grad_norm` as `zeroinf.AdamW`'s."""

    def __init__(
        self,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
        params: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
        *,
        track_grad_norm: bool = False,
        **settings: Any,
    ) -> None:
        if isinstance(optimizer, torch.optim.Optimizer):
            if params is not None or settings:
                raise TypeError(
                    "zeroinf.ShardedOptimizer: given a built optimizer, it takes its parameters and settings from "
                    "it; pass either ShardedOptimizer(torch.optim.SGD(params, lr=...)) or "
                    "ShardedOptimizer(torch.optim.SGD, params, lr=...)"
                )
            if isinstance(optimizer, ShardedOptimizerBase):
                raise TypeError(f"zeroinf.ShardedOptimizer: {type(optimizer).__name__} is sharded already")
            cls: type[torch.optim.Optimizer] = type(optimizer)
            defaults = dict(optimizer.defaults)
            settings = constructor_settings(cls, defaults)
            groups: Any = [dict(g) for g in optimizer.param_groups]
            # States it built at construction (Adagrad's sum: a full-size copy per parameter at stages 0-2)
            # would stay held by the caller's object: the sharded optimizer keeps its own.
            optimizer.state.clear()
        elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            if issubclass(optimizer, ShardedOptimizerBase):
                raise TypeError(
                    f"zeroinf.ShardedOptimizer: {optimizer.__name__} is zeroinf's own: build it directly "
                    f"(zeroinf.{optimizer.__name__}(model, ...))"
                )
            if params is None:
                raise TypeError(
                    f"zeroinf.ShardedOptimizer({optimizer.__name__}, ...) needs the parameters: "
                    f"ShardedOptimizer({optimizer.__name__}, model.parameters(), lr=...)"
                )
            cls = optimizer
            # torch validates the settings and fills its defaults on a stand-in parameter: building it on
            # the model's would allocate states for them (Adagrad's sum) only to drop them.
            defaults = dict(_on_a_flat_piece(cls, settings, lambda: cls([torch.zeros(1)], **settings)).defaults)
            settings = constructor_settings(cls, defaults)
            groups = params
        else:
            raise TypeError(
                "zeroinf.ShardedOptimizer takes a torch.optim.Optimizer class (with parameters and settings) or "
                f"a built one, not {type(optimizer).__name__}"
            )
        self.optimizer_class = cls
        self.hyperparameter_keys = tuple(defaults)
        self._settings = settings  # the constructor's arguments for the instances that run the update
        self._kept: torch.optim.Optimizer | None = None  # runs steps after a parameter's first
        self._kept_lock = threading.Lock()  # the update may run on the background worker (optim/background.py)
        # per (device, fused, capturable): a `step` state as the optimizer makes it (`_step_state`)
        self._step_like: dict[tuple[torch.device, bool, bool], torch.Tensor | int | float] = {}
        # Everything is checked before the base class builds (or takes over) any state. Param groups may
        # differ in settings that change the states kept (SGD's momentum 0 keeps none): each group's names,
        # placed in the store's slots by their place in the union.
        owner, given = (groups, None) if isinstance(groups, nn.Module) else model_of_params(groups, self.display_name)
        group_settings = [
            {k: v for k, v in {**defaults, **g}.items() if k != "params"} for g in (given or [{}])
        ]
        inspected = [inspect_optimizer(cls, constructor_settings(cls, g)) for g in group_settings]
        per_group = [found.names for found in inspected]
        union = tuple(dict.fromkeys(n for names in per_group for n in names))
        if len(union) > MAX_STATES:
            raise UnsupportedOptimizer(
                f"zeroinf.ShardedOptimizer: {cls.__name__}'s param groups keep {len(union)} different tensors "
                f"per parameter together ({', '.join(union)}); zeroinf keeps at most {MAX_STATES}"
            )
        # bf16 states ([Note: bf16 states of a torch optimizer]): widened per window, rounded back
        self._bf16_states = engine_of(owner).cfg.offload.moment_dtype == "bf16"
        self._noise: NoiseTable | None = None
        self.state_names = union  # what the store's two state slots hold
        self.keeps_step = any(found.keeps_step for found in inspected)
        super().__init__(owner, given, defaults, track_grad_norm)
        self._group_names = per_group
        self._group_slots = [[union.index(n) for n in names] for names in per_group]

    @property
    def display_name(self) -> str:
        return f"zeroinf.ShardedOptimizer({self.optimizer_class.__name__})"

    def _update_sub_group(
        self, sg: SubGroup, views: StateViews, grad: torch.Tensor, hyper: list[dict[str, Any]] | None = None
    ) -> None:
        """The torch optimizer's step over one sub-group, one call per param group it holds."""
        had_grad, steps = self.engine.units[sg.unit_index].param_had_grad, self.param_steps[sg.unit_index]
        store_slots = (views.exp_avg, views.exp_avg_sq)
        for gi, all_cuts in self._sub_group_runs[sg.index]:
            slots = [store_slots[k] for k in self._group_slots[gi]]
            cuts = [cut for cut in all_cuts if had_grad[cut[0]]]
            if not cuts:
                continue
            group = self.param_groups[gi] if hyper is None else hyper[gi]
            settings = {k: group[k] for k in self.hyperparameter_keys}
            if self._bf16_states and slots:
                self._update_bf16(sg, views, grad, gi, cuts, slots, settings)
                continue
            # In windows of at most STEP_WINDOW_NUMEL elements on a CPU (each its own piece to the
            # optimizer: the update is elementwise, so the bits are the same), whose passes stay in cache.
            window = STEP_WINDOW_NUMEL if views.master.device.type == "cpu" else max(1, sg.numel)
            ranges = [(lo, min(b, lo + window), steps[slot]) for slot, a, b, _ in cuts for lo in range(a, b, window)]
            self._step_ranges(
                views.master, grad, [(a, b) for a, b, _ in ranges], [n for *_, n in ranges], settings,
                self._group_names[gi], [[s[a:b] for s in slots] for a, b, _ in ranges],
            )

    def _step_ranges(
        self, master: torch.Tensor, grad: torch.Tensor, ranges: list[tuple[int, int]], counts: list[int],
        settings: dict[str, Any], names: tuple[str, ...], states: list[list[torch.Tensor]],
    ) -> None:
        """The torch step over ranges [a, b) of a sub-group's master (each its own parameter to the
        optimizer, its gradient the same range of `grad`), with these states and step counts."""
        pieces = [master[a:b] for a, b in ranges]
        for piece, (a, b) in zip(pieces, ranges, strict=True):
            piece.grad = grad[a:b]
        with self._kept_lock:
            self._step_pieces(pieces, counts, settings, names, states)
        for piece, (a, b) in zip(pieces, ranges, strict=True):
            piece.grad = None
            target = master[a:b]
            if piece.data_ptr() != target.data_ptr():  # the optimizer set `p.data` instead of writing it
                target.copy_(piece)

    def _update_bf16(
        self, sg: SubGroup, views: StateViews, grad: torch.Tensor, gi: int, cuts: list[tuple[int, int, int, int]],
        slots: list[torch.Tensor], settings: dict[str, Any],
    ) -> None:
        """The step over bf16 states: window by window, each state widened to fp32, the torch step,
        then rounded back stochastically with the noise of (parameter, element, step, state)."""
        steps = self.param_steps[sg.unit_index]
        names = self.engine.units[sg.unit_index].param_names
        moments = self._group_slots[gi]  # the store slot of each state: the noise's `moment`
        if self._noise is None:
            self._noise = NoiseTable(views.master.device)
        for slot, a, b, param_start in cuts:
            key, count = param_key(names[slot]), steps[slot]
            for lo in range(a, b, WINDOW_NUMEL):
                hi = min(b, lo + WINDOW_NUMEL)
                wide = [s[lo:hi].float() for s in slots]
                self._step_ranges(views.master, grad, [(lo, hi)], [count], settings, self._group_names[gi], [wide])
                start = param_start + lo - a
                for s, w, moment in zip(slots, wide, moments, strict=True):
                    s[lo:hi].copy_(round_stochastic_(w, self._noise.slice(key, start, count + 1, moment, hi - lo)))

    def _step_state(self, count: int, device: torch.device, settings: dict[str, Any]) -> torch.Tensor | int | float:
        """A parameter's `step` state at `count`, of the type, dtype and device the optimizer gives it on
        `device` with these settings (a float CPU tensor for most, on the device with `fused` or
        `capturable`; a number for some): learnt once from one step of a stand-in parameter there, so a
        run resumed from a checkpoint, whose parameters never take a first step here, has it too."""
        key = (device, bool(settings.get("fused")), bool(settings.get("capturable")))
        like = self._step_like.get(key)
        if like is None:
            stand_in = torch.zeros(1, device=device)
            stand_in.grad = torch.zeros(1, device=device)
            probe = self.optimizer_class([{**settings, "params": [stand_in]}], **self._settings)
            probe.step()
            step = probe.state[stand_in]["step"]
            like = self._step_like[key] = step.detach().clone() if isinstance(step, torch.Tensor) else step
        return torch.full_like(like, float(count)) if isinstance(like, torch.Tensor) else type(like)(count)

    def _step_pieces(self, pieces: list[torch.Tensor], counts: list[int], settings: dict[str, Any],
                     names: tuple[str, ...], states: list[list[torch.Tensor]]) -> None:
        first = any(n == 0 for n in counts)
        group = {"params": pieces, **settings}
        if first:  # torch makes the first step's states itself ([Note: a torch optimizer over shards])
            opt = self.optimizer_class([group], **self._settings)
        else:
            if self._kept is None:
                self._kept = self.optimizer_class([{**group, "params": [torch.zeros(1)]}], **self._settings)
            opt = self._kept
            opt.param_groups = [group]
            opt.state = defaultdict(dict)
        for piece, n, views in zip(pieces, counts, states, strict=True):
            if n == 0:
                continue
            state = opt.state[piece]
            state.clear()
            state.update(zip(names, views, strict=True))
            if self.keeps_step:
                state["step"] = self._step_state(n, piece.device, settings)
        opt.step()
        for piece, views in zip(pieces, states, strict=True):
            state = opt.state[piece]
            for name, view in zip(names, views, strict=True):
                kept = state.get(name)
                if not isinstance(kept, torch.Tensor) or kept.shape != view.shape:
                    raise RuntimeError(
                        f"{self.display_name}: after its step the optimizer holds no state {name!r} shaped as "
                        "the parameter, which it kept when zeroinf inspected it; its state depends on more than "
                        "its settings, which zeroinf cannot shard"
                    )
                if kept.data_ptr() != view.data_ptr():  # made anew (a first step) or replaced
                    view.copy_(kept)
        opt.state = defaultdict(dict)  # hold no views of staging buffers between calls
        opt.param_groups = [{**group, "params": []}]
