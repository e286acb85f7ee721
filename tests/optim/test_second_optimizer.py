"""A second zeroinf.AdamW built for a model that already has one (optim/succession.py [Note: a second
optimizer for one model]): it starts as a fresh torch optimizer does, from the weights the model holds.

Against plain PyTorch (torch's fused AdamW, the kernel zeroinf runs) on the same batches: 3 steps
with a first optimizer, then 3 with a new one of another learning rate and other param groups
(decay / no decay): the same losses and weights, bitwise, at stages 0-3 with the optimizer states on
the device, the host and NVMe (stage 3: the parameters there too), split between host and NVMe, and
with the first optimizer deleted before the second is built, or closed (its states and masters freed:
the new one starts from the weights, still plain PyTorch's bits); with bf16 moments, the run a rebuilt
model with a first optimizer gives; at world 2 (one spawned group) on NVMe, to the parity suite's
fp32 tolerances. The replaced optimizer refuses every use, naming the new one, and its `close()`
leaves the new one's states alone; the fp16 loss scale carries over. Off a step boundary (a backward
waiting for `step()`) the new optimizer is refused and the old one trains on as if nothing happened;
a background save of the old one is published first.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
import zeroinf.checkpoint as ck
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch
from tests.optim.test_split_states import SMALL_IO, _budget
from tests.test_parity import TOLERANCES

FIRST, SECOND = 3, 3
SECOND_LR = LR / 2


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """nanoGPT's groups: weight decay on matrices only."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def _plain(world: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model()
    losses = []
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for step in range(FIRST + SECOND):
        if step == FIRST:
            opt = torch.optim.AdamW(_groups(model), lr=SECOND_LR, fused=True)
        loss = model(*global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _rows(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def _sharded(
    stage: int, offload: dict[str, Any], world: int = 1, rank: int = 0, drop_first: bool = False,
    close_first: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """The loop with a second optimizer after FIRST steps; the losses (averaged over ranks), the
    weights, and the first optimizer (None when dropped)."""
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=LR)
    first: Any = opt
    losses = []
    for step in range(FIRST + SECOND):
        if step == FIRST:
            if close_first:
                opt.close()
            if drop_first:
                del opt, first
                gc.collect()
                first = None
            opt = zeroinf.AdamW(model, lr=SECOND_LR, param_groups=_groups(model))
        x, y = (_rows(t, world, rank) for t in global_batch(step))
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if world > 1:
            torch.distributed.all_reduce(loss := loss.detach().clone())
            loss /= world
        losses.append(loss.item())
    return losses, model.state_dict(), first


def _assert_plain(got: tuple[list[float], dict[str, torch.Tensor], Any], what: str) -> None:
    losses, weights = _plain()
    assert got[0] == losses, what
    assert all(torch.equal(got[1][k], v) for k, v in weights.items()), what


TIERS = {
    "device": {},
    "host": {"optimizer": "host"},
    "nvme": {"optimizer": "nvme"},
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("tier", TIERS)
def test_a_second_optimizer_trains_as_a_fresh_torch_optimizer(stage: int, tier: str, tmp_path: Path) -> None:
    offload = {**TIERS[tier], "nvme_dir": str(tmp_path)}
    if stage == 3 and tier != "device":
        offload["params"] = tier  # on NVMe, fp32: the masters are the parameter file itself
    got = _sharded(stage, offload)
    _assert_plain(got, f"stage {stage}, {tier}")
    old = got[2]
    for use in (old.step, old.zero_grad, old.state_dict, lambda: old.load_state_dict({})):
        with pytest.raises(RuntimeError, match="replaced by a newer one built for the same model"):
            use()
    with pytest.raises(RuntimeError, match="replaced by a newer one"):
        old.backward(torch.zeros((), requires_grad=True))


def test_split_states_and_a_deleted_first_optimizer(tmp_path: Path) -> None:
    budget = _budget(tmp_path, 1, 0.5, params="nvme")
    split = {"params": "nvme", "optimizer": "host", "max_host_bytes": budget, "nvme_dir": str(tmp_path), **SMALL_IO}
    _assert_plain(_sharded(3, split), "split host/NVMe")
    dropped = _sharded(3, {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path)}, drop_first=True)
    _assert_plain(dropped, "first optimizer deleted")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("tier", TIERS)
def test_after_the_first_is_closed_a_new_optimizer_starts_from_the_weights(
    stage: int, tier: str, tmp_path: Path
) -> None:
    """`opt.close()` frees the states and the masters with them (optim/sharded.py [Note: an optimizer
    closed before the model]): an optimizer made afterwards starts as the model's first, from the
    weights the model holds, which in fp32 are the masters: plain PyTorch's bits. (Before, it tried
    to inherit the closed states and failed with an IndexError.)"""
    offload = {**TIERS[tier], "nvme_dir": str(tmp_path)}
    if stage == 3 and tier != "device":
        offload["params"] = tier
    _assert_plain(_sharded(stage, offload, close_first=True), f"stage {stage}, {tier}, first closed")


def test_a_closed_optimizer_refuses_every_use_naming_why(tmp_path: Path) -> None:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, offload={"params": "host", "optimizer": "host"}))
    opt = zeroinf.AdamW(model, lr=LR)
    opt.backward(model(*global_batch(0)))
    opt.step()
    opt.zero_grad()
    opt.close()
    opt.close()  # a second close does nothing
    uses = [opt.step, opt.state_dict, lambda: opt.load_state_dict({}),
            lambda: opt.backward(model(*global_batch(1))), lambda: ck.save(tmp_path / "ckpt", model, opt, step=1)]
    for use in uses:
        with pytest.raises(RuntimeError, match="this zeroinf.AdamW was closed: its states"):
            use()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step_*"))


def test_after_the_first_is_closed_a_weights_only_load_is_let_in(tmp_path: Path) -> None:
    """A closed optimizer no longer counts as the model's: `zeroinf.load(path, model)` loads the
    weights, and the next optimizer takes the checkpoint's fp32 masters (bf16 model: not the bf16
    weights cast up)."""
    cfg = zeroinf.Config(stage=3, param_dtype="bf16", offload={"params": "host", "optimizer": "host"})
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    opt.backward(model(*global_batch(0)))
    opt.step()
    opt.zero_grad()
    ck.save(tmp_path / "ckpt", model, opt, step=1)
    saved = [opt.states.read_unit(ui).master.clone() for ui in range(len(opt.engine.units))]
    with pytest.raises(ValueError, match="this model has an optimizer"):
        zeroinf.load(tmp_path / "ckpt", model)
    opt.close()
    zeroinf.load(tmp_path / "ckpt", model)
    new = zeroinf.AdamW(model, lr=LR)
    masters = [new.states.read_unit(ui).master for ui in range(len(new.engine.units))]
    assert all(torch.equal(a, b) for a, b in zip(masters, saved, strict=True))
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)  # fp32 values, not bf16 ones


def test_bf16_moments_restart_from_zero(tmp_path: Path) -> None:
    """bf16 moments round, so no fp32 torch run matches them: the second optimizer's run equals a run
    whose model is built again, loaded with the weights after the first optimizer's steps, and given
    its first optimizer (fresh moments, step 0), bitwise."""
    offload = {"optimizer": "host", "moment_dtype": "bf16"}
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)
    losses, weights, _ = _sharded(3, offload)
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    for step in range(FIRST):
        opt.backward(model(*global_batch(step)))
        opt.step()
        opt.zero_grad()
    fresh = zeroinf.shard(build_model(), cfg)
    fresh.load_state_dict(model.state_dict())
    opt = zeroinf.AdamW(fresh, lr=SECOND_LR, param_groups=_groups(fresh))
    again = []
    for step in range(FIRST, FIRST + SECOND):
        loss = fresh(*global_batch(step))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        again.append(loss.item())
    assert losses[FIRST:] == again
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())


def test_off_a_step_boundary_the_new_optimizer_is_refused_and_the_old_trains_on(tmp_path: Path) -> None:
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path), "step_in_backward": False}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=LR)
    losses = []
    for step in range(FIRST + SECOND):
        loss = model(*global_batch(step))
        opt.backward(loss)
        if step == 1:
            refused = r"gradients of 1 backward pass\(es\) not stepped yet: call its step"
            with pytest.raises(RuntimeError, match=refused):
                zeroinf.AdamW(model, lr=SECOND_LR)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    plain = build_model()
    ref = torch.optim.AdamW(plain.parameters(), lr=LR, fused=True)
    want = []
    for step in range(FIRST + SECOND):
        loss = plain(*global_batch(step))
        loss.backward()
        ref.step()
        ref.zero_grad()
        want.append(loss.item())
    assert losses == want


def test_a_background_save_of_the_old_optimizer_is_published_first(tmp_path: Path) -> None:
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path / "swap")}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=LR)
    opt.backward(model(*global_batch(0)))
    opt.step()
    opt.zero_grad()
    ck.save(tmp_path / "ckpt", model, opt, 1, blocking=False)
    new = zeroinf.AdamW(model, lr=SECOND_LR)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000001"
    ck.verify(str(tmp_path / "ckpt"))
    opt.close()  # the retired one's close leaves the states it handed over alone
    new.backward(model(*global_batch(1)))
    new.step()
    assert ck.load(tmp_path / "ckpt", model, new)["step"] == 1  # the new optimizer loads what the old saved


def _world2(rank: int, world: int, folder: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": f"{folder}/rank{rank}"}
    losses, weights, _ = _sharded(3, offload, world, rank)
    return losses, weights


def test_at_world_2(tmp_path: Path) -> None:
    """Summed in another order across ranks: tests/test_parity.py's fp32 tolerances."""
    losses, weights = _plain()
    loss_rtol, weight_atol = TOLERANCES["fp32"]
    for got_losses, got_weights in run_ranks(_world2, 2, str(tmp_path)):
        assert got_losses == pytest.approx(losses, rel=loss_rtol)
        for name, want in weights.items():
            assert torch.allclose(got_weights[name], want, rtol=loss_rtol, atol=weight_atol), name


def test_a_deleted_optimizer_with_gradients_pending_asks_for_model_zero_grad(tmp_path: Path) -> None:
    offload = {"optimizer": "host", "step_in_backward": False}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=LR)
    opt.backward(model(*global_batch(0)))
    del opt
    gc.collect()
    with pytest.raises(RuntimeError, match=r"gradients of 1 backward pass\(es\) that no optimizer stepped: call model"):
        zeroinf.AdamW(model, lr=LR)
    model.zero_grad()
    opt = zeroinf.AdamW(model, lr=LR)  # now a fresh start from the initial weights: plain PyTorch's first step
    loss = model(*global_batch(0))
    opt.backward(loss)
    opt.step()
    plain = build_model()
    want = plain(*global_batch(0))
    assert loss.item() == want.item()


def test_the_fp16_loss_scale_carries_over() -> None:
    """The scale tracks the gradients' range, as a torch loop's GradScaler, which outlives its optimizer."""
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, param_dtype="fp16", loss_scale={"initial_scale": 2.0**40})
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    skipped = 0
    for step in range(3):  # 2^40 overflows fp16's gradients: skipped steps halve the scale
        opt.backward(model(*global_batch(step)))
        opt.step()
        opt.zero_grad()
        skipped += opt.last_step_skipped
    assert skipped >= 1 and opt.loss_scale < 2.0**40
    new = zeroinf.AdamW(model, lr=SECOND_LR)
    assert new.loss_scale == opt.scaler.scale
    assert new.scaler.state_dict() == opt.scaler.state_dict()
