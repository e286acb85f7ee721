"""zeroinf.ShardedOptimizer: a torch optimizer's own update over the shards (optim/torch_optimizer.py
[Note: a torch optimizer over shards]).

Against the same torch optimizer on the plain model, same seed and batches, 4 steps: losses and
weights **bitwise** equal at world 1, for SGD (momentum, Nesterov, weight decay; and plain),
Adagrad, RMSprop, Rprop, Adamax, RAdam, Adadelta and torch's AdamW; at stages 0-3 with the states on
the device, the host (the step inside backward) and NVMe (stage 3: parameters there too), split
between host and NVMe, and with clipping (the speculative step inside backward, undone when it
clips). Param groups whose settings keep different states (momentum in one, none in the other) with
an LR scheduler; the built-optimizer form equals the class form. World 2 in one spawned group: every
optimizer bitwise the same optimizer over torch's DistributedDataParallel (odd-sized parameters cut
by the shards included), and within the parity suite's fp32 tolerances of the single process. A
third-party optimizer written as lion-pytorch is (an `int` step, `p.data` replaced) trains bitwise
too. A checkpoint saved mid-run resumes bitwise (stage 3 on NVMe into stage 1 in memory),
`optimizer_state` reads torch's `momentum_buffer`, and loading an SGD checkpoint into AdamW is
refused. In memory only the states kept take room (ledger: 4 bytes per owned element
and state, on the device, the host and a split's host part), and a successor keeping more grows the
store and trains as torch. What cannot be computed over shards is refused with the reason: updates that
are not elementwise (Adafactor) or depend on the shape, per-parameter scalars (NAdam, ASGD), more
than two states (amsgrad), a closure (LBFGS), bf16 moments.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import Case, build_model, global_batch, train_rank_slices, train_torch_ddp
from tests.optim.test_split_states import SMALL_IO, _budget
from tests.test_parity import TOLERANCES
from zeroinf.optim.torch_optimizer import UnsupportedOptimizer

STEPS = 4
SGD_MOMENTUM = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01})
OPTIMIZERS = {
    "sgd-momentum": SGD_MOMENTUM,
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "weight_decay": 0.01}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-3}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-3}),
    "radam": (torch.optim.RAdam, {"lr": 1e-3, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    "adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "torch-adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
}


def _placements(folder: Path) -> dict[str, tuple[int, dict[str, Any], dict[str, Any]]]:
    """name -> (stage, offload, other Config fields)."""
    nvme = str(folder)
    split = {"params": "nvme", "optimizer": "host", "max_host_bytes": _budget(folder, 1, 0.5, params="nvme"),
             "nvme_dir": nvme, **SMALL_IO}
    return {
        "stage0-device": (0, {}, {}),
        "stage1-host": (1, {"optimizer": "host"}, {}),
        "stage2-host": (2, {"optimizer": "host"}, {}),
        "stage3-device": (3, {}, {}),
        "stage3-nvme": (3, {"params": "nvme", "optimizer": "nvme", "nvme_dir": nvme, **SMALL_IO}, {}),
        "stage3-split": (3, split, {}),
        "stage3-host-clipped": (3, {"optimizer": "host", "step_in_backward": True}, {"grad_clip_norm": 0.05}),
    }


def _plain(cls: type[torch.optim.Optimizer], settings: dict[str, Any], clip: float | None = None,
           steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    model = build_model()
    opt = cls(model.parameters(), **settings)
    losses = []
    for step in range(steps):
        loss = model(*global_batch(step))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), opt


def _sharded(cls: type[torch.optim.Optimizer], settings: dict[str, Any], stage: int, offload: dict[str, Any],
             world: int = 1, rank: int = 0, model_name: str = "tiny_gpt",
             **cfg: Any) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Losses, weights, and the speculative steps undone (clipping)."""
    config = zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload, **cfg)
    model = zeroinf.shard(build_model(model_name), config)
    opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
    losses = train_rank_slices(model, opt, rank, world, 0, STEPS)
    weights = model.state_dict()
    opt.close()
    return losses, weights, opt.rollbacks


def _assert_equal(got: tuple[Any, ...], want: tuple[Any, ...],
                  what: str, exact: bool = True) -> None:
    rtol, atol = (0.0, 0.0) if exact else TOLERANCES["fp32"]
    assert len(got[0]) == len(want[0]), what
    for a, b in zip(got[0], want[0], strict=True):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=0.0), (what, got[0], want[0])
    for name, ref in want[1].items():
        assert torch.allclose(got[1][name], ref, rtol=0.0, atol=atol), (what, name)


# Every optimizer in memory at stage 3 and on the host with the step inside backward; SGD with
# momentum (one state) and torch's AdamW (two) at every placement.
CASES = [(o, p) for o in OPTIMIZERS for p in ("stage3-device", "stage2-host")] + [
    (o, p) for o in ("sgd-momentum", "torch-adamw", "adagrad")
    for p in ("stage0-device", "stage1-host", "stage3-nvme", "stage3-split", "stage3-host-clipped")
]


@pytest.mark.parametrize(("optimizer", "placement"), CASES)
def test_bitwise_equal_to_the_torch_optimizer(optimizer: str, placement: str, tmp_path: Path) -> None:
    cls, settings = OPTIMIZERS[optimizer]
    stage, offload, cfg = _placements(tmp_path)[placement]
    want = _plain(cls, settings, clip=cfg.get("grad_clip_norm"))
    start = build_model().state_dict()
    assert max(float((want[1][k] - v).abs().max()) for k, v in start.items()) > 1e-4, "the reference must move"
    # zeroinf's clipping coefficient sums the squares in another order than torch's clip_grad_norm_:
    # clipped steps agree to the parity suite's fp32 tolerances (tests/optim/test_clip.py)
    exact = "grad_clip_norm" not in cfg
    got = _sharded(cls, settings, stage, offload, **cfg)
    _assert_equal(got, want, f"{optimizer} at {placement}", exact)
    assert got[2] == (0 if exact else 1), "clipping undoes the first step taken inside backward, then holds back"


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Matrices with momentum and weight decay; vectors without either (SGD keeps no state for them)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() > 1], "momentum": 0.9, "weight_decay": 0.01},
        {"params": [p for _, p in named if p.dim() <= 1], "momentum": 0.0, "weight_decay": 0.0},
    ]


def _with_schedule(model: torch.nn.Module, opt: Any) -> list[float]:
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / STEPS)
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(step))
        loss.backward()  # zeroinf: the engine takes the gradients (no fp16 scale to apply)
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses


def test_param_groups_keeping_different_states_and_a_schedule(tmp_path: Path) -> None:
    plain_model = build_model()
    plain_opt = torch.optim.SGD(_groups(plain_model), lr=0.05)
    want = (_with_schedule(plain_model, plain_opt), plain_model.state_dict())
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path), **SMALL_IO}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    built = torch.optim.SGD(_groups(model), lr=0.05)  # the built-optimizer form
    opt = zeroinf.ShardedOptimizer(built)
    assert opt.state_names == ("momentum_buffer",)
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.0]
    _assert_equal((_with_schedule(model, opt), model.state_dict()), want, "groups and schedule")
    opt.close()


def _ddp(cls: type[torch.optim.Optimizer], settings: dict[str, Any], model_name: str, rank: int,
         world: int) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    """The torch optimizer over torch's DistributedDataParallel, each rank on its slice (rank 0's weights)."""
    case = Case("ddp", 0, steps=STEPS, model=model_name)
    out = train_torch_ddp(case, rank, world, optimizer=lambda params: cls(params, **settings))
    return out["losses"], out["weights"]


def _world2(rank: int, world: int, folder: str) -> dict[str, Any]:
    out = {}
    for name, (stage, offload, model_name) in {
        "stage1-device": (1, {}, "tiny_gpt"),
        "stage3-nvme": (3, {"params": "nvme", "optimizer": "nvme", "nvme_dir": f"{folder}/r{rank}", **SMALL_IO},
                        "tiny_gpt"),
        "stage2-host-odd": (2, {"optimizer": "host"}, "odd"),  # odd-sized parameters cut by the shards
    }.items():
        for optimizer, (cls, settings) in OPTIMIZERS.items():
            out[f"{optimizer} {name}"] = (
                _sharded(cls, settings, stage, offload, world, rank, model_name=model_name)[:2],
                _ddp(cls, settings, model_name, rank, world),
            )
    return out


def test_world_2(tmp_path: Path) -> None:
    """Every optimizer at two ranks gives bitwise the losses and weights of the same torch optimizer
    over DistributedDataParallel in the same group (tests/test_parity.py says why two ranks can be
    bitwise), and stays within the parity tolerance of the single process."""
    got = run_ranks(_world2, 2, str(tmp_path))
    assert len(got[0]) == 3 * len(OPTIMIZERS)
    for case, (result, ddp) in got[0].items():
        assert result[0] == got[1][case][0][0], case
        _assert_equal(result, ddp, f"world 2 against DDP, {case}")
        if "odd" not in case:
            cls, settings = OPTIMIZERS[case.split()[0]]
            _assert_equal(result, _plain(cls, settings), f"world 2, {case}", exact=False)


def test_checkpoint_resumes_bitwise_and_refuses_another_optimizer(tmp_path: Path) -> None:
    cls, settings = SGD_MOMENTUM
    want_losses, want_weights, plain_opt = _plain(cls, settings)
    nvme = {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path / "swap"), **SMALL_IO}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=nvme))
    opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
    first = train_rank_slices(model, opt, 0, 1, 0, 2)
    zeroinf.save(tmp_path / "ckpt", model, opt, step=2)
    opt.close()
    resumed = zeroinf.shard(build_model(seed=5), zeroinf.Config(stage=1))  # other weights, stage, placement
    opt2 = zeroinf.ShardedOptimizer(cls, resumed.parameters(), **settings)
    zeroinf.load(tmp_path / "ckpt", resumed, opt2)
    rest = train_rank_slices(resumed, opt2, 0, 1, 2, STEPS)
    _assert_equal((first + rest, resumed.state_dict()), (want_losses, want_weights), "resumed")
    # torch's momentum_buffer, read whole: after the 4 steps it equals the plain optimizer's
    named = dict(resumed.named_parameters())
    read = zeroinf.optimizer_state(opt2)
    plain_states = [plain_opt.state[p] for p in plain_opt.param_groups[0]["params"]]  # in named_parameters' order
    for (name, _), state in zip(build_model().named_parameters(), plain_states, strict=True):
        assert set(read[named[name]]) == {"step", "momentum_buffer", "master"}, name
        assert torch.equal(read[named[name]]["momentum_buffer"], state["momentum_buffer"]), name
        assert float(read[named[name]]["step"]) == STEPS, name
    with pytest.raises(KeyError, match="momentum_buffer"):
        opt2.state[named["tok.weight"]]
    adamw_model = zeroinf.shard(build_model(), zeroinf.Config(stage=1))
    adamw = zeroinf.AdamW(adamw_model, lr=1e-3)
    with pytest.raises(zeroinf.CheckpointError, match=r"ShardedOptimizer\(SGD\), keeping \['momentum_buffer'\]"):
        zeroinf.load(tmp_path / "ckpt", adamw_model, adamw)
    with pytest.raises(ValueError, match=r"keeping \['momentum_buffer'\].*this one keeps \['exp_avg', 'exp_avg_sq'\]"):
        adamw.load_state_dict(opt2.state_dict())


class Lion(torch.optim.Optimizer):
    """A third-party optimizer as lion-pytorch writes one: Lion's sign update, an `int` step count,
    and the parameter replaced through `p.data` rather than written in place."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                state["step"] += 1
                update = (state["exp_avg"] * beta1 + p.grad * (1 - beta1)).sign()
                p.data = p * (1 - group["lr"] * group["weight_decay"]) - group["lr"] * update
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)


@pytest.mark.parametrize("placement", ["stage3-nvme", "stage2-host", "stage1-host"])
def test_a_third_party_optimizer(placement: str, tmp_path: Path) -> None:
    settings = {"lr": 1e-3, "weight_decay": 0.1}
    stage, offload, cfg = _placements(tmp_path)[placement]
    _assert_equal(_sharded(Lion, settings, stage, offload, **cfg), _plain(Lion, settings), f"Lion at {placement}")


@pytest.mark.parametrize("optimizer", ["adagrad", "torch-adamw", "rprop"])
def test_a_resumed_optimizer_that_counts_steps(optimizer: str, tmp_path: Path) -> None:
    """Loaded from a checkpoint, no parameter takes a first step in the new optimizer: the `step` state
    torch's update reads is made as torch makes it (it stopped with KeyError 'step' before)."""
    cls, settings = OPTIMIZERS[optimizer]
    host = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload={"optimizer": "host"})
    model = zeroinf.shard(build_model(), host)
    opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
    losses = train_rank_slices(model, opt, 0, 1, 0, 2)
    zeroinf.save(tmp_path / "ckpt", model, opt, step=2)
    opt.close()
    resumed = zeroinf.shard(build_model(seed=5), zeroinf.Config(stage=1))
    opt2 = zeroinf.ShardedOptimizer(cls, resumed.parameters(), **settings)
    zeroinf.load(tmp_path / "ckpt", resumed, opt2)
    losses += train_rank_slices(resumed, opt2, 0, 1, 2, STEPS)
    _assert_equal((losses, resumed.state_dict()), _plain(cls, settings), f"{optimizer} resumed")


def test_a_checkpoint_of_states_in_memory_resumes_on_nvme(tmp_path: Path) -> None:
    """Saved from a host store holding one slot (the other absent: saved as zeros), loaded into NVMe swap files."""
    cls, settings = SGD_MOMENTUM
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=1, offload={"optimizer": "host"}))
    opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
    losses = train_rank_slices(model, opt, 0, 1, 0, 2)
    zeroinf.save(tmp_path / "ckpt", model, opt, step=2)
    nvme = {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path / "swap"), **SMALL_IO}
    resumed = zeroinf.shard(build_model(seed=5), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=nvme))
    opt2 = zeroinf.ShardedOptimizer(cls, resumed.parameters(), **settings)
    zeroinf.load(tmp_path / "ckpt", resumed, opt2)
    losses += train_rank_slices(resumed, opt2, 0, 1, 2, STEPS)
    _assert_equal((losses, resumed.state_dict()), _plain(cls, settings), "host -> NVMe")


def test_set_optimizer_state_writes_the_torch_states() -> None:
    cls, settings = SGD_MOMENTUM
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
    train_rank_slices(model, opt, 0, 1, 0, 1)
    p = dict(model.named_parameters())["tok.weight"]
    shape = dict(build_model().named_parameters())["tok.weight"].shape  # at stage 3 `p` is a placeholder
    zeroinf.set_optimizer_state(opt, {p: {"momentum_buffer": torch.full(shape, 2.0)}})
    assert bool((zeroinf.optimizer_state(opt, [p])[p]["momentum_buffer"] == 2.0).all())
    with pytest.raises(ValueError, match="unknown state.*known: step, momentum_buffer"):
        zeroinf.set_optimizer_state(opt, {p: {"exp_avg": torch.zeros(1)}})


def _continues_as_torch(model: torch.nn.Module, opt: Any, cls: type[torch.optim.Optimizer],
                        settings: dict[str, Any], start: int, stop: int) -> None:
    """Steps `start`..`stop` of the sharded model equal torch's optimizer started on its weights now."""
    plain = build_model()
    plain.load_state_dict(model.state_dict())
    plain_opt = cls(plain.parameters(), **settings)
    for step in range(start, stop):
        got = train_rank_slices(model, opt, 0, 1, step, step + 1)
        loss = plain(*global_batch(step))
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert got == [loss.item()], step
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_second_optimizer_takes_over_from_adamw() -> None:
    """optim/succession.py: masters kept, states reset; the torch optimizer's first step makes its own."""
    cls, settings = SGD_MOMENTUM
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=2))
    train_rank_slices(model, zeroinf.AdamW(model, lr=1e-3), 0, 1, 0, 1)
    _continues_as_torch(model, zeroinf.ShardedOptimizer(cls, model.parameters(), **settings), cls, settings, 1, 3)


def _state_bytes(model: torch.nn.Module, tier: zeroinf.Tier) -> int:
    return zeroinf.engine_of(model).ledger.live_bytes(tier, "optimizer_state")


@pytest.mark.parametrize("placement", ["host", "device", "split"])
def test_only_the_states_kept_take_memory(placement: str, tmp_path: Path) -> None:
    """4 bytes per owned element and state kept: SGD with momentum one, plain SGD none, AdamW two
    (the masters live in the parameter shards here, [Note: masters in the memory shard]). The split
    (half of AdamW's states under the cap) is sized for each optimizer's states: the fewer it keeps,
    the more units on the host (plain SGD's all), each taking its master and states kept there; the
    NVMe part is on disk (measured in the NVMe tests below)."""
    offload: dict[str, Any] = {"device": {}, "host": {"optimizer": "host"}}.get(placement, {})
    if placement == "split":
        offload = {"params": "nvme", "optimizer": "host", "max_host_bytes": _budget(tmp_path, 1, 0.5, params="nvme"),
                   "nvme_dir": str(tmp_path), **SMALL_IO}
    tier = zeroinf.Tier.DEVICE if placement == "device" else zeroinf.Tier.HOST
    kept, on_host = {}, {}
    moments = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}
    for name, build in {
        "adamw": lambda m: zeroinf.AdamW(m, lr=1e-3),
        "sgd-momentum": lambda m: zeroinf.ShardedOptimizer(torch.optim.SGD, m.parameters(), lr=0.1, momentum=0.9),
        "sgd": lambda m: zeroinf.ShardedOptimizer(torch.optim.SGD, m.parameters(), lr=0.1),
    }.items():
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
        before = _state_bytes(model, tier)
        opt = build(model)
        train_rank_slices(model, opt, 0, 1, 0, 1)
        kept[name] = _state_bytes(model, tier) - before
        numel = sum(u.owned_numel for u in zeroinf.engine_of(model).units)
        if placement != "split":
            assert kept[name] == 4 * numel * moments[name], (name, kept[name], numel)
        else:  # parameters on NVMe: the masters are states of their own, but the resident root's without a split
            engine = zeroinf.engine_of(model)
            split = getattr(opt.states, "split", None)
            on_host[name] = numel if split is None else split.host_numel
            in_shards = sum(
                u.owned_numel for u, shared in zip(engine.units, engine.unit_plan.masters_in_memory_shard, strict=True)
                if shared
            )
            expected = 4 * (1 + moments[name]) * on_host[name] - 4 * in_shards
            assert kept[name] == expected, (name, kept[name], on_host[name], in_shards)
        opt.close()
    if placement == "split":
        assert on_host["adamw"] < on_host["sgd-momentum"] <= on_host["sgd"], on_host
    else:
        assert kept["adamw"] - kept["sgd-momentum"] == kept["sgd-momentum"] - kept["sgd"] > 0, kept


def test_only_the_states_kept_move_to_and_from_nvme(tmp_path: Path) -> None:
    """optim/nvme_states.py [Note: state slots an optimizer does not use, on NVMe]: a step reads and
    writes 4 bytes per owned element for the master and for each state kept, whose swap files alone
    exist; and it trains as torch."""
    moved = {}
    for name, (cls, settings), kept in (("adamw", OPTIMIZERS["torch-adamw"], 2), ("sgd-momentum", SGD_MOMENTUM, 1),
                                        ("sgd", OPTIMIZERS["sgd"], 0)):
        offload = {"optimizer": "nvme", "nvme_dir": str(tmp_path / name), "step_in_backward": False, **SMALL_IO}
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
        opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
        losses = train_rank_slices(model, opt, 0, 1, 0, STEPS - 1)
        before = opt.states.engine.stats()  # the swap files' own I/O engine: the bytes that really moved
        losses += train_rank_slices(model, opt, 0, 1, STEPS - 1, STEPS)
        after = opt.states.engine.stats()
        numel = sum(u.owned_numel for u in zeroinf.engine_of(model).units)
        traffic = opt.states.traffic.last_step
        assert traffic["nvme_read_bytes"] == traffic["nvme_written_bytes"] == 4 * (1 + kept) * numel, (name, traffic)
        read, written = after.bytes_read - before.bytes_read, after.bytes_written - before.bytes_written
        assert read == written == 4 * (1 + kept) * numel, (name, read, written)
        kinds = sorted(f.name.removeprefix("zeroinf-rank0-optimizer_") for f in (tmp_path / name).glob("*optimizer_*"))
        assert kinds == sorted(["master.swap", "exp_avg.swap", "exp_avg_sq.swap"][: 1 + kept]), (name, kinds)
        _assert_equal((losses, model.state_dict()), _plain(cls, settings), f"{name} on NVMe")
        moved[name] = traffic["nvme_read_bytes"]
        opt.close()
    assert moved["adamw"] > moved["sgd-momentum"] > moved["sgd"]


def test_a_successor_with_more_states_grows_the_store_and_trains_as_torch() -> None:
    """SGD (no state) then torch's AdamW (two) on the host: the store gains its slots, zeroed, and
    the ledger follows; training equals torch's from the same weights."""
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload={"optimizer": "host"})
    model = zeroinf.shard(build_model(), cfg)
    train_rank_slices(model, zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1), 0, 1, 0, 1)
    numel = sum(u.owned_numel for u in zeroinf.engine_of(model).units)
    assert _state_bytes(model, zeroinf.Tier.HOST) == 0
    opt = zeroinf.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert _state_bytes(model, zeroinf.Tier.HOST) == 8 * numel
    _continues_as_torch(model, opt, torch.optim.AdamW, {"lr": 1e-3}, 1, 3)
    opt.close()
    assert _state_bytes(model, zeroinf.Tier.HOST) == 0


def test_on_nvme_a_successor_with_more_states_makes_their_swap_files(tmp_path: Path) -> None:
    """Plain SGD on NVMe has a master file alone; torch's AdamW after it gets both moment files
    (zeros, as fresh files read) and trains as torch from the same weights; the disk ledger follows."""
    offload = {"optimizer": "nvme", "nvme_dir": str(tmp_path), "step_in_backward": False, **SMALL_IO}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    sgd = zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    train_rank_slices(model, sgd, 0, 1, 0, 1)
    assert [f.name for f in tmp_path.glob("*optimizer_*")] == ["zeroinf-rank0-optimizer_master.swap"]
    on_disk = zeroinf.engine_of(model).ledger.live_bytes(zeroinf.Tier.NVME)
    opt = zeroinf.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    files = {f.name: f.stat().st_size for f in tmp_path.glob("*optimizer_*")}
    assert sorted(files) == [f"zeroinf-rank0-optimizer_{k}.swap" for k in ("exp_avg", "exp_avg_sq", "master")]
    assert len(set(files.values())) == 1, files  # each the master's size
    assert zeroinf.engine_of(model).ledger.live_bytes(zeroinf.Tier.NVME) == on_disk + 2 * max(files.values())
    _continues_as_torch(model, opt, torch.optim.AdamW, {"lr": 1e-3}, 1, 3)
    opt.close()


def test_on_nvme_a_successor_reads_no_stale_states(tmp_path: Path) -> None:
    """zeroinf.AdamW leaves moments in the swap files, SGD (no state) steps past them without reading
    or clearing them, then torch's AdamW must start from zero moments: the same as torch from the weights."""
    offload = {"optimizer": "nvme", "nvme_dir": str(tmp_path), "step_in_backward": False, **SMALL_IO}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=2, offload=offload))
    train_rank_slices(model, zeroinf.AdamW(model, lr=1e-3), 0, 1, 0, 2)
    train_rank_slices(model, zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1), 0, 1, 2, 3)
    opt = zeroinf.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    _continues_as_torch(model, opt, torch.optim.AdamW, {"lr": 1e-3}, 3, 5)
    opt.close()


@pytest.mark.parametrize(
    ("cls", "settings", "message"),
    [
        (torch.optim.Adafactor, {}, "Adafactor's update is not elementwise"),
        (torch.optim.NAdam, {}, r"NAdam keeps per-parameter state \['mu_product'\]"),
        (torch.optim.ASGD, {}, r"ASGD keeps per-parameter state \['eta', 'mu'\]"),
        (torch.optim.Adam, {"amsgrad": True}, "keeps 3 tensors per parameter.*max_exp_avg_sq"),
        (torch.optim.RMSprop, {"centered": True, "momentum": 0.9}, "keeps 3 tensors per parameter"),
        (torch.optim.LBFGS, {}, "LBFGS.step needs a closure"),
        (torch.optim.Muon, {}, "Muon with .* fails on a flat 1-D tensor.*Muon only supports 2D parameters"),
        (torch.optim.SGD, {"lr": -1.0}, "SGD with .* fails on a flat 1-D tensor.*Invalid learning rate"),
    ],
)
def test_what_cannot_be_sharded_is_refused_with_the_reason(cls: Any, settings: dict[str, Any], message: str) -> None:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=1))
    with pytest.raises(UnsupportedOptimizer, match=message):
        zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)


class ShapeDependent(torch.optim.Optimizer):
    """An update by the parameter's row norms: elementwise over a flat parameter, not over a matrix."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                rows = p.grad if p.dim() == 1 else p.grad / p.grad.norm(dim=1, keepdim=True)
                p.sub_(rows, alpha=group["lr"])


def test_other_refusals() -> None:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=1))
    with pytest.raises(UnsupportedOptimizer, match="depends on the parameter's shape"):
        zeroinf.ShardedOptimizer(ShapeDependent, model.parameters())
    with pytest.raises(TypeError, match="takes its parameters and settings from it"):
        zeroinf.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), lr=0.2)
    with pytest.raises(TypeError, match="is zeroinf's own"):
        zeroinf.ShardedOptimizer(zeroinf.AdamW, model.parameters())
    with pytest.raises(TypeError, match="needs the parameters"):
        zeroinf.ShardedOptimizer(torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer class"):
        zeroinf.ShardedOptimizer("sgd", model.parameters())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ShardedOptimizer\(SGD\): these parameters belong to no sharded model"):
        zeroinf.ShardedOptimizer(torch.optim.SGD, build_model().parameters(), lr=0.1)


@pytest.mark.parametrize("name", ["lion", "sgd-momentum", "rmsprop"])
def test_bf16_states_are_placement_invariant_and_follow_fp32_ones(name: str, tmp_path: Path) -> None:
    """`offload.moment_dtype = "bf16"` for a torch optimizer ([Note: bf16 states of a torch
    optimizer]): every placement (stage 3 with states on the host and on NVMe in small sub-groups,
    stage 1 on the device) trains the same bits, the losses follow fp32 states', and the states take
    2 bytes an element each on the host."""
    cls, settings = {
        "lion": (zeroinf.Lion, {"lr": 1e-3, "weight_decay": 0.1}), "sgd-momentum": SGD_MOMENTUM,
        "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3}),
    }[name]

    def run(stage: int, tier: str, moments: str) -> tuple[list[float], torch.Tensor, int]:
        folder = tmp_path / f"{stage}-{tier}-{moments}"
        folder.mkdir()
        offload = zeroinf.OffloadConfig(params=tier if stage == 3 else "device", optimizer=tier, moment_dtype=moments,
                                        nvme_dir=str(folder) if tier == "nvme" else None, sub_group_numel=2048)
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload))
        opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
        losses = train_rank_slices(model, opt, 0, 1, 0, 5)
        weights = torch.cat([v.float().flatten() for v in model.state_dict().values()])
        states = zeroinf.engine_of(model).ledger.live_bytes(zeroinf.Tier.HOST, "optimizer_state")
        opt.close()
        return losses, weights, states

    host, nvme, device = run(3, "host", "bf16"), run(3, "nvme", "bf16"), run(1, "device", "bf16")
    assert host[0] == nvme[0] == device[0] and torch.equal(host[1], nvme[1]) and torch.equal(host[1], device[1])
    fp32 = run(3, "host", "fp32")
    assert host[0] == pytest.approx(fp32[0], rel=1e-3), (host[0], fp32[0])
    # the masters are the fp32 parameter shards here (counted with them): the states alone, half the bytes
    assert fp32[2] == 2 * host[2] > 0, (fp32[2], host[2])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_in_windows_on_a_cpu_the_step_is_the_same_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU each parameter run is stepped in windows of STEP_WINDOW_NUMEL elements (its passes
    stay in cache; optim/torch_optimizer.py `_update_sub_group`): with windows of 100 elements, so
    that every matrix is cut and the last window is partial, every optimizer trains plain PyTorch's
    bits (states on the host, stage 3, the step after backward)."""
    from zeroinf.optim import torch_optimizer

    monkeypatch.setattr(torch_optimizer, "STEP_WINDOW_NUMEL", 100)
    cls, settings = OPTIMIZERS[name]
    offload = {"params": "host", "optimizer": "host", "step_in_backward": False}
    got = _sharded(cls, settings, 3, offload)
    _assert_equal(got, _plain(cls, settings), f"{name} in windows of 100")
