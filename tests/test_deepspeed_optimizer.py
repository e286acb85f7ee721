"""A DeepSpeed config's optimizer and scheduler sections (deepspeed_optimizer.py [Note: DeepSpeed's
optimizer and scheduler sections]): the learning rates of WarmupLR, WarmupDecayLR and
WarmupCosineLR step by step against DeepSpeed's formulas (and DeepSpeed's own classes where it is
installed), the optimizer each `type` becomes with DeepSpeed's defaults, a sharded run under both
equal to plain PyTorch under the same schedule, and what is refused, by name."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from tests._parity import build_model, global_batch
from zeroinf.deepspeed_optimizer import DeepSpeedSchedule

# The schedules are stepped here without an optimizer step, which torch's scheduler warns about.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")

STEPS = 14


def _lrs(sched: Any, opt: torch.optim.Optimizer, steps: int = STEPS) -> list[float]:
    """The first group's lr each optimizer step runs with: before any scheduler step, then after each."""
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps - 1):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def _plain(lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


# DeepSpeed's learning rate at its `last_batch_iteration` i (the k-th optimizer step runs at i = k - 2),
# written out from its documented formulas.
def _warmup(i: int, n: int, kind: str) -> float:
    n = max(2, n)
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


def _expected(kind: str, i: int, p: dict[str, Any], base: float) -> float:
    n = max(2, p["warmup_num_steps"])
    if kind == "WarmupCosineLR":
        if i < 0:
            return 0.0
        if i < n:
            return base * (p["warmup_min_ratio"] + _warmup(i, n, p["warmup_type"]) * (1 - p["warmup_min_ratio"]))
        progress = min(1.0, (i - n + 1) / max(1, p["total_num_steps"] - n))
        return base * max(0.0, p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * (1 + math.cos(math.pi * progress)) / 2)
    low, high = p["warmup_min_lr"], p["warmup_max_lr"]
    if i < 0:
        return low
    if i < n:
        gamma = _warmup(i, n, p["warmup_type"])
    elif kind == "WarmupDecayLR":
        gamma = max(0.0, (p["total_num_steps"] - i) / max(1.0, p["total_num_steps"] - n))
    else:
        gamma = 1.0
    return low + (high - low) * gamma


CASES = {
    "WarmupLR-log": ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 6,
                                  "warmup_type": "log"}),
    "WarmupLR-linear": ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5,
                                     "warmup_type": "linear"}),
    "WarmupDecayLR": ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                        "warmup_num_steps": 4, "warmup_type": "linear"}),
    "WarmupCosineLR": ("WarmupCosineLR", {"total_num_steps": 11, "warmup_min_ratio": 0.1, "warmup_num_steps": 3,
                                          "cos_min_ratio": 0.05, "warmup_type": "log"}),
    "one-warmup-step": ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1,
                                     "warmup_type": "log"}),
}


@pytest.mark.parametrize("case", CASES)
def test_the_schedules_give_deepspeeds_learning_rates(case: str) -> None:
    kind, params = CASES[case]
    opt = _plain()
    got = _lrs(DeepSpeedSchedule(opt, kind, **params), opt)
    want = [_expected(kind, k - 1, params, 1e-3) for k in range(STEPS)]
    assert got == pytest.approx(want, rel=1e-12, abs=0.0), (case, got, want)
    # DeepSpeed's schedule starts at iteration -1: the first step runs at the warmup's start (cosine: at 0)
    assert got[0] == (0.0 if kind == "WarmupCosineLR" else params["warmup_min_lr"]), got


@pytest.mark.parametrize("case", CASES)
def test_the_schedules_match_deepspeeds_own_classes(case: str) -> None:
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    kind, params = CASES[case]
    ours_opt, theirs_opt = _plain(), _plain()
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    assert _lrs(DeepSpeedSchedule(ours_opt, kind, **params), ours_opt) == _lrs(theirs, theirs_opt)


def test_the_scheduler_state_resumes() -> None:
    kind, params = CASES["WarmupDecayLR"]
    opt = _plain()
    sched = DeepSpeedSchedule(opt, kind, **params)
    for _ in range(5):
        sched.step()
    again_opt = _plain()
    again = DeepSpeedSchedule(again_opt, kind, **params)
    again.load_state_dict(sched.state_dict())
    sched.step()
    again.step()
    assert again_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _sharded() -> torch.nn.Module:
    return zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0))


def test_each_optimizer_type_with_deepspeeds_defaults() -> None:
    opt, sched = zeroinf.optimizer_from_deepspeed(_sharded(), {"optimizer": {"type": "Adam", "params": {"lr": 2e-4}}})
    assert type(opt) is zeroinf.AdamW and sched is None  # DeepSpeed's "Adam" is AdamW by default
    assert opt.param_groups[0]["weight_decay"] == 0.0 and opt.param_groups[0]["lr"] == 2e-4  # its kernels' default
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False, "weight_decay": 0.1,
                                                       "torch_adam": True, "betas": [0.8, 0.9]}}}
    opt, _ = zeroinf.optimizer_from_deepspeed(_sharded(), config)
    assert type(opt) is zeroinf.Adam and opt.param_groups[0]["betas"] == (0.8, 0.9)
    opt, _ = zeroinf.optimizer_from_deepspeed(_sharded(), {"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}})
    assert type(opt) is zeroinf.AdamW and opt.param_groups[0]["eps"] == 1e-6
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    opt, _ = zeroinf.optimizer_from_deepspeed(_sharded(), config)
    assert isinstance(opt, zeroinf.ShardedOptimizer) and opt.display_name == "zeroinf.ShardedOptimizer(SGD)"
    assert opt.param_groups[0]["momentum"] == 0.9


def _train(model: torch.nn.Module, opt: Any, sched: Any) -> tuple[list[float], list[float]]:
    losses, lrs = [], []
    for step in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        loss = model(*global_batch(step))
        (opt.backward(loss) if hasattr(opt, "backward") else loss.backward())
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, lrs


def test_a_sharded_run_under_the_sections_equals_plain_pytorch(tmp_path: Path) -> None:
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_min_lr": 0,
                                                          "warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                                          "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(__import__("json").dumps(config))
    model = zeroinf.shard(build_model(), zeroinf.Config.from_deepspeed(path))
    opt, sched = zeroinf.optimizer_from_deepspeed(model, path)
    plain = build_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    params = config["scheduler"]["params"]
    plain_sched = DeepSpeedSchedule(plain_opt, "WarmupDecayLR", **params)  # type: ignore[arg-type]
    ours, theirs = _train(model, opt, sched), _train(plain, plain_opt, plain_sched)
    assert ours[1] == theirs[1] and ours[1][:3] == [0.0, 0.0, 1e-3], ours[1]
    assert ours[0] == pytest.approx(theirs[0], rel=1e-6, abs=1e-6), (ours[0], theirs[0])
    opt.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"optimizer": {"type": "Lamb"}}, "LAMB scales each parameter's update by its whole norm"),
        ({"optimizer": {"type": "OneBitAdam"}}, "compresses the gradient communication"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr.*give the number"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
        ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "always corrects the bias"),
        ({"optimizer": {"type": "Nonsense"}}, "optimizer.type.*Nonsense.*torch.optim optimizer"),
        ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}, "optimizer.params.*AdamW: .*momentum"),
        ({}, "no optimizer section"),
        ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "OneCycle"}}, "OneCycleLR"),
        ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
         "total_num_steps.*the run's step count"),
        ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}},
         "warmup_type.*'log' or 'linear'"),
        ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}},
         "scheduler.params.*warmup_steps"),
        ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "Nonsense"}}, "scheduler.type.*Nonsense"),
        ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "StepLR", "params": {"steps": 2}}}, "StepLR: "),
    ],
)
def test_what_cannot_be_built_is_refused_by_name(config: dict[str, Any], message: str) -> None:
    with pytest.raises(zeroinf.ConfigError, match=message):
        zeroinf.optimizer_from_deepspeed(_sharded(), config)


def test_a_torch_optimizer_refuses_what_it_does_not_take() -> None:
    from zeroinf.optim.torch_optimizer import UnsupportedOptimizer

    with pytest.raises(UnsupportedOptimizer, match="SGD.*unexpected keyword argument 'moment'"):
        zeroinf.optimizer_from_deepspeed(_sharded(), {"optimizer": {"type": "SGD", "params": {"moment": 0.9}}})


def test_torch_schedulers_are_built_as_deepspeed_builds_them() -> None:
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}}
    opt, sched = zeroinf.optimizer_from_deepspeed(_sharded(), config)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert _lrs(sched, opt, 5) == [0.1, 0.1, 0.05, 0.05, 0.025]
