"""The parity oracle: train a small transformer with plain single-process PyTorch and with zeroinf.

The reference sees the whole global batch in one process and uses `torch.optim.AdamW`. For bf16 and
fp16 it keeps fp32 master weights, computes forward/backward in a low-precision copy, and steps
the masters (the semantics zeroinf promises); fp32 is plain PyTorch. Data and initial weights come
from the seed, so every world size trains on exactly the same global batches.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, D_MODEL, N_HEAD, N_LAYER = 64, 16, 32, 4, 3
GLOBAL_BATCH = 8
LR = 3e-3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        # no qkv bias: the key bias gets an exactly-zero gradient (softmax is shift-invariant), and Adam
        # would turn its rounding noise into full-size updates that no two summation orders agree on.
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False), nn.Linear(D_MODEL, D_MODEL)
        self.fc, self.out = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, N_HEAD, c // N_HEAD).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied across the root unit

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


ODD = 37  # OddNet's width: no parameter a multiple of 8 elements


class OddBlock(nn.Module):
    """Norm before the matrix: the weight starts at an odd element of the unit, so a shard boundary
    cuts it at an odd element of its own (partition/flat_buffer.py [Note: why every parameter starts
    on 64 elements])."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(ODD), nn.Linear(ODD, ODD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class OddNet(nn.Module):
    """A model of odd-sized parameters (widths of 37): where the optimizer's pieces end matters."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, ODD)
        self.blocks = nn.ModuleList([OddBlock() for _ in range(3)])
        self.head = nn.Linear(ODD, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float().view(-1, VOCAB), targets.reshape(-1))


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    dtype: str = "fp32"
    accum: int = 1
    sync_every_micro_step: bool = False
    clip: float | None = None
    clip_value: float | None = None  # Config.grad_clip_value; the reference calls clip_grad_value_
    overflow_step: int | None = None  # fp16: multiply that step's loss by inf
    initial_scale: float = 1024.0  # fp16 loss scale at step 0
    overrides: tuple[tuple[str, object], ...] = ()
    model: str = "tiny_gpt"  # or "zoo" (tests/_zoo.py), or "odd" (OddNet)
    steps: int = 10
    weight_decay: float = 0.1
    compile_backend: str | None = None  # train through torch.compile(model, backend=...)
    batch: int = GLOBAL_BATCH  # samples per global batch: a multiple of world size x accumulation


def global_batch(step: int, seed: int = 1234, batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    data = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def micro_batches(case: Case, rank: int, world_size: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of `step`'s global batch, cut into `case.accum` micro-batches of (x, y)."""
    if case.batch % (world_size * case.accum):
        raise ValueError(f"{case.name}: {case.batch} samples do not split over {world_size} ranks x {case.accum}")
    micro = case.batch // world_size // case.accum
    x, y = global_batch(step, batch=case.batch)
    first = rank * case.accum
    return [(x[(first + m) * micro : (first + m + 1) * micro], y[(first + m) * micro : (first + m + 1) * micro])
            for m in range(case.accum)]


def train_step(model: nn.Module, opt: object, step: int) -> float:
    """One optimizer step of a sharded TinyGPT on `global_batch(step)`; returns the loss."""
    x, y = global_batch(step)
    loss = model(x, y)
    opt.backward(loss)  # type: ignore[attr-defined]
    opt.step()  # type: ignore[attr-defined]
    opt.zero_grad()  # type: ignore[attr-defined]
    return loss.item()


def plain_grad_norms(steps: int, max_norm: float) -> list[float]:
    """What torch's clip_grad_norm_(max_norm) returns each step of plain PyTorch training the test model
    with fused AdamW on the global batches (`max_norm=inf`: the norms without clipping)."""
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    norms = []
    for step in range(steps):
        x, y = global_batch(step)
        model(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return norms


def plain_weights(steps: int, after_step: Callable[[nn.Module], None] | None = None) -> dict[str, torch.Tensor]:
    """The test model's weights after `steps` steps of plain PyTorch (fused AdamW, the global batches,
    from seed 0); `after_step(model)` runs after each optimizer step."""
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for step in range(steps):
        x, y = global_batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
    return model.state_dict()


def _clamp_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def wgan_clipping_matches_plain(model: nn.Module, opt: Any, clip_ours: Callable[[], None], steps: int = 3) -> bool:
    """WGAN's loop on the sharded `model` against plain PyTorch from the same seed: every weight
    clamped to [-0.05, 0.05] after each step, on the plain model in place and on ours by `clip_ours`
    (the way under test). True when the final weights are bitwise equal."""
    for step in range(steps):
        x, y = global_batch(step)
        opt.backward(model(x, y))
        opt.step()
        opt.zero_grad()
        clip_ours()
    ours = model.state_dict()
    return all(torch.equal(ours[k], v) for k, v in plain_weights(steps, _clamp_weights).items())


def build_model(name: str = "tiny_gpt", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "zoo":
        from tests._zoo import Zoo

        return Zoo()
    if name == "odd":
        return OddNet()
    return TinyGPT()


def train_reference(
    case: Case, device: torch.device | None = None, grad_norms: list[float] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: fp32 masters + (for bf16/fp16) a low-precision compute copy; whole global batch.
    On `device` (default: the CPU). With clipping, `grad_norms` (if given) gets each step's total
    norm as `clip_grad_norm_` returns it."""
    device = device or torch.device("cpu")
    master = build_model(case.model).to(device)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=case.weight_decay)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    compute = copy.deepcopy(master).to(dtype) if dtype != torch.float32 else master
    scale = case.initial_scale if case.dtype == "fp16" else 1.0
    losses = []
    for step in range(case.steps):
        x, y = (t.to(device) for t in global_batch(step, batch=case.batch))
        if step == case.overflow_step:  # the engine skips this step and halves the scale
            scale /= 2
            losses.append(float("nan"))
            continue
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                    c.copy_(m)
        loss = compute(x, y)
        (loss * scale).backward()
        losses.append(loss.item())
        if compute is not master:
            for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                m.grad = None if c.grad is None else c.grad.float() / scale  # unused/frozen: no grad
                c.grad = None
        if case.clip_value is not None:
            torch.nn.utils.clip_grad_value_(master.parameters(), case.clip_value)
        if case.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(master.parameters(), case.clip)
            if grad_norms is not None:
                grad_norms.append(norm.item())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in master.named_parameters()}


def train_zeroinf(case: Case, rank: int, world_size: int, device: torch.device | None = None) -> dict:
    """The same training through zeroinf on this rank's slice of every global batch; on `device`
    (default: the topology's)."""
    import zeroinf

    cfg = zeroinf.Config(
        stage=case.stage, param_dtype=case.dtype, grad_accum_steps=case.accum,
        sync_every_micro_step=case.sync_every_micro_step, grad_clip_norm=case.clip, grad_clip_value=case.clip_value,
        loss_scale=zeroinf.LossScaleConfig(initial_scale=case.initial_scale), **dict(case.overrides),
    )
    topology = zeroinf.Topology.single(device) if device is not None else None
    model = zeroinf.shard(build_model(case.model), cfg, topology)
    device = zeroinf.engine_of(model).topo.device
    opt = zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=case.weight_decay)
    forward: Callable[..., torch.Tensor] = model
    if case.compile_backend is not None:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # each case compiles its own frames; the counts below are its own
        counters.clear()
        forward = torch.compile(model, backend=case.compile_backend)
    frames_compiled = []  # frames torch.compile has compiled so far, after each step
    losses, skipped, stepped_in_backward, grad_norms = [], [], [], []
    for step in range(case.steps):
        total = torch.zeros((), device=device)
        for x, y in micro_batches(case, rank, world_size, step):
            loss = forward(x.to(device), y.to(device)) / case.accum
            total += loss.detach().float()
            opt.backward(loss * math.inf if step == case.overflow_step else loss)
        opt.step()
        opt.zero_grad()
        mean = rank_mean(total, world_size)
        losses.append(float("nan") if step == case.overflow_step else mean)
        skipped.append(opt.last_step_skipped)
        grad_norms.append(opt.last_grad_norm)
        stepped_in_backward.append(opt.units_stepped_in_backward)
        if case.compile_backend is not None:
            frames_compiled.append(counters["frames"]["ok"])
    report = zeroinf.memory_report(model)
    return {
        "losses": losses,
        "skipped": skipped,
        "grad_norms": grad_norms,  # AdamW.last_grad_norm after each step
        "stepped_in_backward": stepped_in_backward,  # units per step (optim/adamw.py)
        "rollbacks": opt.rollbacks,
        "background_kernels": opt._background.submitted if opt._background is not None else 0,
        "weights": _weights(model, rank),
        "optimizer_state_bytes": report["device"]["by_tag"].get("optimizer_state", 0),
        "host_optimizer_state_bytes": report["host"]["by_tag"].get("optimizer_state", 0),
        "optimizer_split": split.to_json() if (split := getattr(opt.states, "split", None)) is not None else None,
        "collectives_last_step": report["collectives_last_step"],
        "transfers": report["transfers"],
        "frames_compiled": frames_compiled,
    }


def rank_rows(
    step: int, rank: int, world: int, rows: int = 8, features: int = 8, device: torch.device | None = None
) -> torch.Tensor:
    """This rank's share of step `step`'s random inputs (`rows` x `features`, seeded by the step)."""
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(step))
    per = rows // world
    return x[rank * per : (rank + 1) * per].to(device)


def sharded_on_rows(
    model: nn.Module, opt: Any, rank: int, world: int, steps: int, device: torch.device | None = None
) -> list[float]:
    """Train a sharded `model` with its zeroinf optimizer on `rank_rows` (the model returns its loss):
    the losses (mean over ranks)."""
    losses = []
    for step in range(steps):
        loss = model(rank_rows(step, rank, world, device=device))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(rank_mean(loss.detach().float(), world))
    return losses


def masters_by_hand(
    master: nn.Module, compute_copy: Callable[[], nn.Module], rank: int, world: int, steps: int, lr: float,
    device: torch.device | None = None,
) -> list[float]:
    """bf16 training with fp32 masters by hand on `rank_rows`: each step a compute copy of `master`
    (`compute_copy()`), its inputs in bf16 (as zeroinf casts floating inputs), its gradients widened
    to fp32 and averaged over the ranks, fused AdamW without weight decay on the masters. The losses
    (mean over ranks)."""
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0, fused=True)
    losses = []
    for step in range(steps):
        compute = compute_copy()
        loss = compute(rank_rows(step, rank, world, device=device).to(torch.bfloat16))
        loss.backward()
        for c, m in zip(compute.parameters(), master.parameters(), strict=True):
            assert c.grad is not None
            m.grad = c.grad.float()
            if world > 1:
                torch.distributed.all_reduce(m.grad)
                m.grad /= world
        opt.step()
        opt.zero_grad()
        losses.append(rank_mean(loss.detach().float(), world))
    return losses


def rank_mean(value: torch.Tensor, world: int) -> float:
    """The mean over the group of every rank's `value` (a loss), in place; every rank calls it."""
    if world > 1:
        torch.distributed.all_reduce(value)
        value /= world
    return value.item()


def _weights(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    full = model.state_dict()  # a collective at stage 3: every rank calls it
    names = {n for n, _ in model.named_parameters()}
    if rank != 0:
        return None
    return {n: t.detach().to("cpu", torch.float32, copy=True) for n, t in full.items() if n in names}


def run_cases(rank: int, world_size: int, cases: list[Case], ddp: tuple[str, ...] = ()) -> dict[str, dict]:
    """zeroinf on every case; for the cases named in `ddp`, plain data parallelism too (`"ddp"`: in
    fp32 torch's DistributedDataParallel, in bf16 the same by hand with fp32 masters)."""
    out = {case.name: train_zeroinf(case, rank, world_size) for case in cases}
    for case in cases:
        if case.name in ddp:
            reference = train_torch_ddp if case.dtype == "fp32" else train_data_parallel_with_masters
            out[case.name]["ddp"] = reference(case, rank, world_size)
    return out


def train_data_parallel_with_masters(
    case: Case, rank: int, world_size: int, average: Callable[[torch.Tensor], None] | None = None, seed: int = 0
) -> dict:
    """Mixed-precision data parallelism by hand, as zeroinf promises it (and FSDP2's
    MixedPrecisionPolicy(param_dtype, reduce_dtype=float32) does): fp32 master weights, a copy in the
    compute dtype for forward and backward, its gradients widened to fp32 and added over the
    micro-steps (DDP's `no_sync`: reduced once, at the last), all-reduced and averaged (or averaged
    in place by `average`), fused AdamW on the masters; no clipping or loss scaling. The losses (mean
    over ranks), rank 0's weights as the model holds them (the masters rounded to the compute dtype),
    and this rank's whole state so ("state")."""
    if case.dtype != "bf16" or case.sync_every_micro_step or case.clip is not None or case.clip_value is not None:
        raise ValueError(f"{case.name}: the masters reference trains bf16 without per-micro-step sync or clipping")
    master = build_model(case.model, seed=seed)
    compute = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=case.weight_decay, fused=True)
    losses = []
    for step in range(case.steps):
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                c.copy_(m)
        total = torch.zeros(())
        for x, y in micro_batches(case, rank, world_size, step):
            loss = compute(x, y) / case.accum
            loss.backward()
            total += loss.detach().float()
            for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                if c.grad is not None:  # unused, frozen: no gradient
                    m.grad = c.grad.float() if m.grad is None else m.grad.add_(c.grad)
                    c.grad = None
        for m in master.parameters():
            if m.grad is not None and average is not None:
                average(m.grad)
            elif m.grad is not None and world_size > 1:
                torch.distributed.all_reduce(m.grad)
                m.grad /= world_size
        opt.step()
        opt.zero_grad()
        losses.append(rank_mean(total, world_size))
    rounded = copy.deepcopy(master).to(torch.bfloat16)
    state = {k: v.float().clone() for k, v in rounded.state_dict().items()}
    return {"losses": losses, "weights": _weights(rounded, rank), "state": state}


def train_torch_ddp(
    case: Case, rank: int, world_size: int,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> dict:
    """The same data-parallel training through `torch.nn.parallel.DistributedDataParallel` and
    `torch.optim.AdamW(fused=True)` (zeroinf's CPU step is that kernel; `optimizer(params)` makes
    another), fp32, without clipping: the losses (mean over ranks) and rank 0's weights. Accumulation
    skips the reduction of all but the last micro-step (`no_sync`), as zeroinf does without
    `sync_every_micro_step`."""
    from torch.nn.parallel import DistributedDataParallel

    if case.dtype != "fp32" or case.clip is not None or case.clip_value is not None or case.sync_every_micro_step:
        raise ValueError(f"{case.name}: the DDP reference trains fp32 without clipping or per-micro-step sync")
    torch.manual_seed(0)
    model = build_model(case.model)
    # the zoo's unused branch: DDP must be told, or it waits for its gradient
    ddp = DistributedDataParallel(model, find_unused_parameters=case.model == "zoo") if world_size > 1 else model
    opt = (optimizer(model.parameters()) if optimizer is not None else
           torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=case.weight_decay, fused=True))
    losses = []
    for step in range(case.steps):
        total = torch.zeros(())
        for m, (x, y) in enumerate(micro_batches(case, rank, world_size, step)):
            last = m == case.accum - 1
            with contextlib.nullcontext() if last or world_size == 1 else ddp.no_sync():  # type: ignore[operator]
                loss = ddp(x, y) / case.accum
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(rank_mean(total, world_size))
    return {"losses": losses, "weights": _weights(model, rank)}


def with_name(case: Case, suffix: str) -> Case:
    return replace(case, name=f"{case.name}{suffix}")


def train_rank_slices(
    model: nn.Module, opt: object, rank: int, world: int, start: int, stop: int, batch: int = GLOBAL_BATCH
) -> list[float]:
    """Steps `start`..`stop` of the global batches (`batch` samples each), this rank training on its
    slice; the mean loss over ranks per step (every rank calls it)."""
    if batch % world:
        raise ValueError(f"{batch} samples do not split over {world} ranks")
    per = batch // world
    losses = []
    for step in range(start, stop):
        x, y = global_batch(step, batch=batch)
        loss = model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        opt.backward(loss)  # type: ignore[attr-defined]
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad()  # type: ignore[attr-defined]
        losses.append(rank_mean(loss.detach().clone(), world))
    return losses


def train_micro_steps(
    model: nn.Module, opt: object, rank: int, world: int, accum: int, steps: int = 3,
    after_backward: Callable[[], None] | None = None,
    around: Callable[[], contextlib.AbstractContextManager[Any]] | None = None, overflow_step: int | None = None,
) -> list[float]:
    """`steps` optimizer steps, this rank training on its slice of each global batch in `accum`
    micro-steps (`after_backward()` after each; each micro-step's forward and backward inside
    `around()`; the loss times inf at `overflow_step`); every micro-step's unscaled loss on this rank."""
    per = GLOBAL_BATCH // world // accum  # the global batch split over ranks, then over micro-steps
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        x, y = x[rank * per * accum : (rank + 1) * per * accum], y[rank * per * accum : (rank + 1) * per * accum]
        for micro in range(accum):
            with around() if around is not None else contextlib.nullcontext():
                loss = model(x[micro * per : (micro + 1) * per], y[micro * per : (micro + 1) * per])
                scaled = loss / accum if step != overflow_step else loss / accum * math.inf
                opt.backward(scaled)  # type: ignore[attr-defined]
            if after_backward is not None:
                after_backward()
            losses.append(loss.item())
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad()  # type: ignore[attr-defined]
    return losses


def step_over_micro_batches(
    opt: Any, loss_of: Callable[[int, int], torch.Tensor], rows: int, accum: int, world: int
) -> float:
    """One optimizer step over this rank's `rows` rows in `accum` micro-batches, `loss_of(start,
    stop)` being the loss of rows [start, stop); the step's loss averaged over ranks."""
    micro = rows // accum
    total = torch.zeros(())
    for m in range(accum):
        loss = loss_of(m * micro, (m + 1) * micro) / accum
        opt.backward(loss)
        total += loss.detach()
    opt.step()
    opt.zero_grad()
    return rank_mean(total, world)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Two state dicts with the same names and bit-for-bit equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_diff_then_close(model: nn.Module, opt: Any, plain: nn.Module) -> float:
    """The largest absolute difference between a sharded model's gathered weights and a plain
    model's (a collective: every rank calls it); then closes the optimizer and the engine."""
    import zeroinf

    state = model.state_dict()
    diff = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    opt.close()
    zeroinf.engine_of(model).close()
    return diff
