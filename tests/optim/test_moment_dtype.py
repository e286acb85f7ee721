"""Adam's moments in bf16 (`offload.moment_dtype = "bf16"`; optim/moments.py [Note: bf16 moments]).

- The stochastic rounding from first principles: a bf16 value stays as it is; between two bf16
  neighbours, over all 2^16 noise values the share rounded up is exactly the distance from the lower
  one, for both signs and across a binade; a second moment decayed by 0.999 a step follows 0.999^t
  in the mean (rounding to nearest would never move it).
- The noise of a piece is the whole parameter's noise cut where the piece is, across the period.
- Training equals a plain PyTorch loop that keeps bf16 moments itself (the fused AdamW kernel on
  widened moments, rounded with the same noise): bitwise at world 1 with the states on the device,
  the host (stepped inside and after backward) and NVMe (cut into sub-groups and windows), a
  host/NVMe split, at stages 1-3; at world 2 every placement gives the same bits as every other, and
  stays within the fp32 tolerance of that loop.
- Bytes: the states take 4 bytes per element fewer than with fp32 moments, on the ledger and on NVMe
  (files and traffic per step).
- Checkpoints keep fp32 states: saved with bf16 moments they resume bitwise with bf16 moments (in
  another placement too) and continue with fp32 moments.
- On a task the model can learn, bf16 moments follow fp32 ones.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import pytest
import torch
from torch.optim.adamw import adamw as functional_adamw

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch, train_rank_slices
from zeroinf.optim.moments import PERIOD, NoiseTable, noise_index, param_key, round_stochastic_
from zeroinf.partition.wrap import discover_units
from zeroinf.planner.unit_plan import UnitShape, plan_units, state_element_bytes

STEPS = 4
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
STATE_TAGS = ("optimizer_state", "optimizer_master", "optimizer_exp_avg", "optimizer_exp_avg_sq")  # the ledger's
SUB_GROUP_NUMEL = 3000  # the tiny model's units own 2.6k-12.6k elements: most are cut, and so are windows


# -- the rounding ---------------------------------------------------------------------------------------
def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).long() & 0xFFFFFFFF


def test_bf16_values_are_kept_whatever_the_noise() -> None:
    values = torch.tensor([0.0, 1.0, -1.0, 3.140625, -2.0**-100, 2.0**100], dtype=torch.bfloat16).float()
    for v in values:
        x = torch.full((1 << 16,), float(v))
        round_stochastic_(x, torch.arange(1 << 16, dtype=torch.int32))
        assert torch.equal(x, torch.full_like(x, float(v))), float(v)


@pytest.mark.parametrize("value", [1.0 + 2.0**-10, -(1.0 + 3 * 2.0**-12), 0.2, -7.3e-5, 2.0 - 2.0**-20, 3.3e12])
def test_the_share_rounded_up_is_the_distance_from_the_lower_neighbour(value: float) -> None:
    x = torch.full((1 << 16,), value)
    low = int(_bits(x[:1]).item()) & 0xFFFF  # the distance, in 2^-16 of the bf16 spacing
    lower = (_bits(x[:1]) & 0xFFFF0000).to(torch.int64).item()
    round_stochastic_(x, torch.arange(1 << 16, dtype=torch.int32))
    bits = _bits(x)
    assert set((bits & 0xFFFF).tolist()) == {0}  # every result is a bf16 value
    up = int((bits != lower).sum())
    assert up == low, (value, up, low)  # exactly: every noise value is used once
    assert set(bits.tolist()) <= {lower, lower + 0x10000}  # the two neighbours (a carry is the next binade)
    assert torch.equal(x.bfloat16().float(), x)


def test_a_decaying_second_moment_follows_its_mean() -> None:
    table, n, beta2 = NoiseTable(torch.device("cpu")), 4096, 0.999
    v = torch.ones(n, dtype=torch.bfloat16)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    for t in range(1, 2001):
        w = v.float() * beta2
        v.copy_(round_stochastic_(w, table.of(param_key("v"), n, t, 1)))
        nearest.copy_(nearest.float() * beta2)
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))  # to nearest: stuck at 1
    assert v.float().mean().item() == pytest.approx(beta2**2000, rel=0.01)


def test_a_pieces_noise_is_the_parameters_noise_where_the_piece_is() -> None:
    table = NoiseTable(torch.device("cpu"), window=4096)
    key, numel = param_key("blocks.0.fc.weight"), PERIOD + 5000
    for step in (1, 7, 1000):
        whole = table.of(key, numel, step, 0)
        for start in (0, 1, PERIOD - noise_index(key, 0, step, 0) - 2, PERIOD - 5, PERIOD + 17):
            assert torch.equal(table.slice(key, start, step, 0, 4096), whole[start : start + 4096])
        assert not torch.equal(table.of(key, 4096, step, 1), whole[:4096])  # the two moments differ


# -- training against a plain loop ----------------------------------------------------------------------
def train_reference(
    steps: int = STEPS, device: torch.device | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the whole global batch, AdamW with bf16 moments written out parameter by parameter."""
    device = device or torch.device("cpu")
    model = build_model().to(device)
    table = NoiseTable(device)
    moments = {
        n: [torch.zeros(p.numel(), dtype=torch.bfloat16, device=device) for _ in range(2)]
        for n, p in model.named_parameters()
    }
    counts = dict.fromkeys(moments, 0)
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in global_batch(step))
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for name, p in model.named_parameters():
                m, v = (t.float() for t in moments[name])
                functional_adamw(
                    [p.view(-1)], [p.grad.view(-1)], [m], [v], [], [torch.tensor(float(counts[name]), device=device)],
                    fused=True,
                    amsgrad=False, beta1=BETAS[0], beta2=BETAS[1], lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-8,
                    maximize=False,
                )
                counts[name] += 1
                for k, (wide, kept) in enumerate(zip((m, v), moments[name], strict=True)):
                    kept.copy_(round_stochastic_(wide, table.of(param_key(name), p.numel(), counts[name], k)))
                p.grad = None
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "s3-device": (3, {}),
    "s3-host": (3, {"optimizer": "host"}),
    "s3-host-after-backward": (3, {"optimizer": "host", "gradients": "host", "step_in_backward": False}),
    "s3-nvme": (3, {"params": "nvme", "optimizer": "nvme", "gradients": "nvme"}),
    "s3-split": (3, {"params": "nvme", "optimizer": "host", "split": 0.5}),  # half the states' bytes on host
    "s1-host": (1, {"optimizer": "host"}),
    "s2-nvme": (2, {"optimizer": "nvme"}),
}
SMALL_IO = {"sub_group_numel": SUB_GROUP_NUMEL, "buffer_count": 3,
            "aio": {"workers": 1, "block_bytes": 16384, "queue_depth": 1}}


def _config(case: str, folder: str, moment_dtype: str = "bf16", world: int = 1) -> zeroinf.Config:
    stage, tiers = CASES[case]
    tiers = dict(tiers)
    share = tiers.pop("split", None)
    offload = zeroinf.OffloadConfig(**tiers, nvme_dir=folder, moment_dtype=moment_dtype, **SMALL_IO)
    cfg = zeroinf.Config(stage=stage, offload=offload, persist_threshold_bytes=0)
    if share is None:
        return cfg
    # A host cap leaving `share` of the states' bytes for them once the engine's other host buffers fit.
    plan = plan_units([UnitShape.of(spec) for spec in discover_units(build_model(), ())], cfg, world)
    budget = plan.other_host_bytes() + int(share * state_element_bytes(offload) * plan.owned_numel)
    return dataclasses.replace(cfg, offload=dataclasses.replace(offload, max_host_bytes=budget))


def train(case: str, rank: int, world: int, folder: str, moment_dtype: str = "bf16") -> dict[str, Any]:
    os.makedirs(os.path.join(folder, case), exist_ok=True)
    model = zeroinf.shard(build_model(), _config(case, os.path.join(folder, case), moment_dtype, world))
    opt = zeroinf.AdamW(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    losses = train_rank_slices(model, opt, rank, world, 0, STEPS)
    report = zeroinf.memory_report(model)
    weights = {n: t.detach().float().clone() for n, t in model.state_dict().items()}
    out = {
        "losses": losses, "weights": weights if rank == 0 else None,
        "state_bytes": {
            t: sum(n for tag, n in report[t]["by_tag"].items() if tag in STATE_TAGS) for t in ("device", "host", "nvme")
        },
        "sub_groups": [sg.numel for sg in opt.states.sub_groups],
        "traffic": dict(opt.states.traffic.last_step),
        "owned": sum(u.owned_numel for u in zeroinf.engine_of(model).units),
        "split": getattr(opt.states, "split", None) is not None,
    }
    opt.close()
    zeroinf.engine_of(model).close()
    return out


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_reference()


def test_every_placement_at_world_1_is_bitwise_the_plain_loop(reference: Any, tmp_path: Any) -> None:
    ref_losses, ref_weights = reference
    for case in CASES:
        got = train(case, 0, 1, str(tmp_path))
        assert got["losses"] == ref_losses, case
        for name, ref in ref_weights.items():
            assert torch.equal(got["weights"][name], ref), (case, name)
        if case == "s3-split":
            assert got["split"], "the host budget was meant to split the states over host and NVMe"


def test_a_step_that_clips_rounds_the_same_inside_and_after_backward(tmp_path: Any) -> None:
    """NVMe states with clipping step speculatively inside backward, are undone (the clip triggers every
    step) and stepped again after it: the same noise for the same Adam step, so the same bits as a run
    that steps after backward only."""
    runs = {}
    for inside in (True, False):
        folder = tmp_path / str(inside)
        folder.mkdir()
        offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(folder), moment_dtype="bf16",
                                        step_in_backward="auto" if inside else False, **SMALL_IO)
        model = zeroinf.shard(build_model(), zeroinf.Config(
            stage=3, offload=offload, persist_threshold_bytes=0, grad_clip_norm=0.05))
        opt = zeroinf.AdamW(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        losses = []
        for step in range(STEPS):
            x, y = global_batch(step)
            loss = model(x, y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[inside] = (losses, {n: t.clone() for n, t in model.state_dict().items()}, opt.rollbacks)
        opt.close()
        zeroinf.engine_of(model).close()
    assert runs[True][2] >= 1  # the speculative step was undone at least once
    assert runs[True][0] == runs[False][0]
    for name, t in runs[False][1].items():
        assert torch.equal(runs[True][1][name], t), name


def test_the_states_take_four_bytes_per_element_less(tmp_path: Any) -> None:
    for case in ("s3-host", "s3-nvme", "s3-split"):
        bf16 = train(case, 0, 1, str(tmp_path / "bf16"))
        fp32 = train(case, 0, 1, str(tmp_path / "fp32"), moment_dtype="fp32")
        saved = {t: fp32["state_bytes"][t] - bf16["state_bytes"][t] for t in ("device", "host", "nvme")}
        if case == "s3-split":  # the split itself moves with the element size: compare the total
            assert sum(saved.values()) >= 4 * fp32["owned"] * 0.9, (case, saved)
            continue
        if case == "s3-host":
            assert saved == {"device": 0, "host": 4 * fp32["owned"], "nvme": 0}, (saved, fp32["owned"])
        else:  # two moment files, each slot aligned to 4 KiB
            aligned = sum(-(-4 * n // 4096) * 4096 - -(-2 * n // 4096) * 4096 for n in fp32["sub_groups"])
            assert saved == {"device": 0, "host": 0, "nvme": 2 * aligned}, (saved, fp32["sub_groups"])
            for direction in ("read", "written"):  # each moment read and written at 2 bytes instead of 4
                key = f"nvme_{direction}_bytes"
                assert fp32["traffic"][key] - bf16["traffic"][key] == 4 * fp32["owned"], (direction, fp32, bf16)


def _world2(rank: int, world: int, folder: str) -> dict[str, Any]:
    out = {case: train(case, rank, world, folder) for case in ("s3-device", "s3-nvme", "s3-split", "s1-host")}
    out["checkpoint"] = _resume(rank, world, folder)
    return out


def _resume(rank: int, world: int, folder: str) -> dict[str, list[float]]:
    """Save at step 2 with bf16 moments on NVMe; resume with bf16 moments on the host, and with fp32."""
    ckpt = os.path.join(folder, "ckpt")
    model = zeroinf.shard(build_model(), _config("s3-nvme", os.path.join(folder, "saved"), world=world))
    opt = zeroinf.AdamW(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    train_rank_slices(model, opt, rank, world, 0, 2)
    zeroinf.save(ckpt, model, opt, step=2)
    out = {"straight": train_rank_slices(model, opt, rank, world, 2, 5)}
    for name, case, moments in (("bf16", "s3-host", "bf16"), ("fp32", "s3-host", "fp32")):
        torch.manual_seed(1)
        resumed = zeroinf.shard(build_model(seed=1), _config(case, os.path.join(folder, name), moments, world))
        resumed_opt = zeroinf.AdamW(resumed, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        zeroinf.load(ckpt, resumed, resumed_opt)
        out[name] = train_rank_slices(resumed, resumed_opt, rank, world, 2, 5)
    return out


def test_world_2_placements_agree_bitwise_and_with_the_plain_loop(reference: Any) -> None:
    ref_losses, ref_weights = reference
    with tempfile.TemporaryDirectory(prefix="zeroinf-bf16-moments-") as folder:
        ranks = run_ranks(_world2, 2, folder, timeout_s=300)
    first = ranks[0]["s3-device"]
    for case in ("s3-device", "s3-nvme", "s3-split", "s1-host"):
        got = ranks[0][case]
        assert got["losses"] == first["losses"], case
        assert ranks[1][case]["losses"] == got["losses"], case
        for name, ref in ref_weights.items():
            assert torch.equal(got["weights"][name], first["weights"][name]), (case, name)
            # fp32 sums in another order can flip a rounding: one bf16 step of a moment, LR-sized at most
            torch.testing.assert_close(got["weights"][name], ref, rtol=0, atol=LR * 1e-2, msg=f"{case} {name}")
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), case
    for rank in ranks:
        ckpt = rank["checkpoint"]
        assert ckpt["bf16"] == ckpt["straight"]  # fp32 states in the checkpoint hold the bf16 moments exactly
        assert ckpt["fp32"] == pytest.approx(ckpt["straight"], rel=1e-4)  # widened moments, rounded no more


def test_bf16_moments_learn_like_fp32_ones(tmp_path: Any) -> None:
    """A repeated batch the tiny GPT memorizes: 30 steps at a higher rate, the loss curves side by side."""
    curves = {}
    for moments in ("fp32", "bf16"):
        cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=zeroinf.OffloadConfig(
            optimizer="host", moment_dtype=moments))
        model = zeroinf.shard(build_model(), cfg)
        opt = zeroinf.AdamW(model, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
        x, y = global_batch(0)
        losses = []
        for _ in range(30):
            loss = model(x, y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curves[moments] = losses
    assert curves["bf16"][-1] < 0.25 * curves["bf16"][0]
    for a, b in zip(curves["bf16"], curves["fp32"], strict=True):
        assert a == pytest.approx(b, rel=0.05, abs=0.02)


def test_an_unknown_moment_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"offload\.moment_dtype.*'fp32', 'bf16'"):
        zeroinf.OffloadConfig(moment_dtype="fp16")
    assert zeroinf.OffloadConfig(moment_dtype="bfloat16").moment_dtype == "bf16"
