"""`zeroinf.gathered`: read and write full parameters of a sharded model.

World 2, stage 3, parameters and optimizer states on NVMe (one spawned group):
- a write inside `gathered(modify=True)` is seen by the next forward on every rank (compared with a
  plain model holding the same weights), by the gathered `state_dict`, and survives an optimizer
  step with lr 0 (so it reached the fp32 masters, not only the compute shard);
- `modifier_rank=1`: rank-dependent writes end as rank 1's everywhere;
- reading nested inside writing works; a unit gathered twice for writing is refused;
- bf16: the masters of elements left alone keep their unrounded fp32 values;
- forwards inside a block: the engine releases units after use, but not one a block holds (that
  lost the block's writes, and its commit then failed); inside a block over every parameter,
  forwards (a generation loop) gather nothing;
- a penalty over model.parameters() added to the loss trains as plain PyTorch inside a block over
  every parameter (backward inside it, the optimizer stepping units there: the block's end waits for
  their refreshing all-gathers), also when clipping undoes and redoes that step; outside, backward
  names the block as the fix; training through such a block is bitwise training without it
  (placements stepping inside backward, clipping, an fp16 overflow, accumulation).
World 1 in process: parameters of a model that is not sharded are refused; parameters parked by
`zeroinf.init()` can be edited before `shard`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests.partition.test_init import Net


def _offloaded_cfg(folder: str, dtype: str = "fp32") -> zeroinf.Config:
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=folder)
    return zeroinf.Config(stage=3, param_dtype=dtype, persist_threshold_bytes=0, offload=offload)


def _step(model: torch.nn.Module, opt: zeroinf.AdamW, idx: torch.Tensor) -> None:
    loss = model(idx).float().logsumexp(-1).mean()
    opt.backward(loss)
    opt.step()
    opt.zero_grad()


def _round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    folder = os.path.join(root, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    model = zeroinf.shard(Net(), _offloaded_cfg(folder))
    opt = zeroinf.AdamW(model, lr=1e-2, weight_decay=0.0)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(rank))
    _step(model, opt, idx)
    weight = model.blocks[1].up.weight
    new_values = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 1000
    out: dict[str, Any] = {}
    with zeroinf.gathered([weight, model.blocks[2].down.weight], modify=True) as (w, _):
        out["shape_inside"] = tuple(w.shape)
        with zeroinf.gathered(model.blocks[2].down.weight):  # a read nested in a write
            out["nested_read_shape"] = tuple(model.blocks[2].down.weight.shape)
        try:
            with zeroinf.gathered(weight, modify=True):
                pass
        except RuntimeError as exc:
            out["nested_write_error"] = str(exc)
        w.copy_(new_values)
    out["shape_after"] = tuple(weight.shape)  # sharded again: an empty placeholder
    state = model.state_dict()
    out["state_has_new"] = torch.equal(state["blocks.1.up.weight"], new_values)
    plain = Net()
    plain.load_state_dict(state)
    with torch.no_grad():
        out["forward_matches_plain"] = torch.equal(model(idx), plain(idx))
    for group in opt.param_groups:
        group["lr"] = 0.0
    _step(model, opt, idx)
    out["survives_step"] = torch.equal(model.state_dict()["blocks.1.up.weight"], new_values)
    with zeroinf.gathered(model.blocks[0].up.bias, modify=True, modifier_rank=1):
        model.blocks[0].up.bias.fill_(float(rank))
    out["modifier_rank_value"] = model.state_dict()["blocks.0.up.bias"].unique().tolist()
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def _bf16_masters(rank: int, world: int, root: str) -> dict[str, Any]:
    folder = os.path.join(root, f"bf16-rank{rank}")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    model = zeroinf.shard(Net(), _offloaded_cfg(folder, "bf16"))
    opt = zeroinf.AdamW(model, lr=1e-2)
    engine = zeroinf.engine_of(model)
    unit_index = engine.unit_index_of(model.blocks[1].up.weight)
    assert unit_index is not None
    before = opt.states.read_unit(unit_index).master.clone()
    with zeroinf.gathered(model.blocks[1].up.weight, modify=True) as (w,):
        w[0].fill_(0.25)  # one row; the rest of the unit is left alone
    after = opt.states.read_unit(unit_index).master
    changed = (after != before).nonzero().flatten()
    unit = engine.units[unit_index]
    slot = next(s for s, n in zip(unit.layout.slots, unit.param_names, strict=True) if n == "blocks.1.up.weight")
    row = torch.arange(slot.offset, slot.offset + 32)  # row 0 of the weight, in the unsharded flat buffer
    owned_row = row[(row >= unit.owned_start) & (row < unit.owned_end)] - unit.owned_start
    opt.close()
    engine.close()
    return {
        "changed": changed.tolist(), "owned_row": owned_row.tolist(),
        "row_masters": after[owned_row].unique().tolist() if len(owned_row) else [],
        "unrounded_before": bool((before != before.bfloat16().float()).any()),
    }


def _forwards_inside(rank: int, world: int, root: str) -> dict[str, Any]:
    folder = os.path.join(root, f"inside-rank{rank}")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    plain = Net()
    model = zeroinf.shard(copy.deepcopy(plain), _offloaded_cfg(folder))
    engine = zeroinf.engine_of(model)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(rank))
    weight = model.blocks[1].up.weight
    out: dict[str, Any] = {}
    with zeroinf.gathered(weight, modify=True) as (w,), torch.no_grad():
        w.mul_(2.0)
        plain.blocks[1].up.weight.mul_(2.0)
        out["inside_matches_plain"] = torch.equal(model(idx), plain(idx))
        out["held_after_forward"] = tuple(weight.shape)
    state = model.state_dict()
    out["write_kept"] = all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    gathers = engine.counter.total
    with torch.no_grad():
        expected = [model(idx) for _ in range(3)]
    with zeroinf.gathered(list(model.parameters())), torch.no_grad():
        before = gathers["all_gather"]
        outputs = [model(idx) for _ in range(3)]  # as each decoding step of a generation
        out["gathers_inside"] = gathers["all_gather"] - before
    out["same_outputs"] = all(torch.equal(a, b) for a, b in zip(expected, outputs, strict=True))
    engine.close()
    return out


def _penalty(rank: int, world: int, root: str, clip: float | None) -> dict[str, Any]:
    """An L2 penalty over model.parameters() added to the loss: inside a gathered block (backward
    included) it trains as plain PyTorch; outside, backward names the block as the fix. With `clip`,
    clipping triggers, so the step made inside backward is undone and redone after it."""
    folder = os.path.join(root, f"penalty-{clip}-rank{rank}")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    plain = Net()
    cfg = dataclasses.replace(_offloaded_cfg(folder), grad_clip_norm=clip)
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    opt = zeroinf.AdamW(model, lr=1e-2, weight_decay=0.0)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))  # the same on every rank

    def penalized(m: torch.nn.Module) -> torch.Tensor:
        return m(idx).float().logsumexp(-1).mean() + 1e-2 * sum(p.pow(2).sum() for p in m.parameters())

    engine = zeroinf.engine_of(model)
    out: dict[str, Any] = {"plain": [], "ours": [], "refreshes_in_flight": []}
    for _ in range(3):
        loss = penalized(plain)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        plain_opt.step()
        plain_opt.zero_grad()
        with zeroinf.gathered(list(model.parameters())):
            ours = penalized(model)
            opt.backward(ours)  # steps units inside backward, whose whole copies are refreshed
        # the block's end waited for those refreshes before freeing the copies (unit.py [Note: a
        # step's refresh of a gathered unit]; freeing them in flight corrupted the heap)
        out["refreshes_in_flight"] += [u.name for u in engine.units if u._refresh_handle is not None]
        opt.step()
        opt.zero_grad()
        out["plain"].append(loss.item())
        out["ours"].append(ours.item())
    out["rollbacks"] = opt.rollbacks
    state = model.state_dict()
    out["weights_diff"] = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    try:
        opt.backward(penalized(model))
        out["outside_error"] = ""
    except RuntimeError as e:
        out["outside_error"] = str(e)
    engine.close()
    return out


# Training through a block over every parameter is bitwise training without it (the block only keeps
# units whole): placements that step inside backward, clipping that undoes that step, an fp16
# overflow that skips one, gradient accumulation.
THROUGH_BLOCK = {
    "nvme-clip": dict(p="nvme", o="nvme", g="nvme", dtype="fp32", clip=0.05, accum=1, overflow=None),
    "host-fp16-overflow": dict(p="host", o="host", g="host", dtype="fp16", clip=1.0, accum=1, overflow=1),
    "device-bf16-accum": dict(p="device", o="device", g="device", dtype="bf16", clip=None, accum=2, overflow=None),
    "nvme-host-resident": dict(p="nvme", o="host", g="device", dtype="bf16", clip=0.05, accum=2, overflow=None),
}


def _train_through_block(rank: int, world: int, folder: str, case: dict[str, Any], through: bool) -> dict[str, Any]:
    from tests._parity import build_model, train_micro_steps

    offload = zeroinf.OffloadConfig(
        params=case["p"], optimizer=case["o"], gradients=case["g"], nvme_dir=folder, sub_group_numel=5000
    )
    cfg = zeroinf.Config(
        stage=3, param_dtype=case["dtype"], grad_accum_steps=case["accum"], grad_clip_norm=case["clip"],
        offload=offload, **({} if case["p"] == "nvme" and case["o"] == "host" else {"persist_threshold_bytes": 0}),
    )
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    losses = train_micro_steps(
        model, opt, rank, world, case["accum"], steps=4, overflow_step=case["overflow"],
        around=(lambda: zeroinf.gathered(list(model.parameters()))) if through else None,
    )
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    out = {"losses": losses, "weights": weights, "rollbacks": opt.rollbacks}
    zeroinf.engine_of(model).close()
    return out


def _through_block(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for name, case in THROUGH_BLOCK.items():
        runs = [
            _train_through_block(rank, world, os.path.join(root, f"through-{name}-{through}-rank{rank}"), case, through)
            for through in (False, True)
        ]
        out[name] = {
            "same_losses": runs[0]["losses"] == runs[1]["losses"],
            "same_weights": all(torch.equal(runs[0]["weights"][k], v) for k, v in runs[1]["weights"].items()),
            "rollbacks": runs[1]["rollbacks"],
        }
    return out


def _frozen_outside_units(rank: int, world: int, root: str) -> dict[str, Any]:
    """A LoRA layer's merge inside one `gathered` call: its adapters (trainable, in units) and its
    frozen base weight (outside units at stages 0-2, in a frozen unit at stage 3). At stages 0-2 the
    call used to refuse the base weight ("belongs to no sharded model"), so `zeroinf finetune --out`
    failed after training at every stage but 3. Oracle: peft's merge on the plain model."""
    from peft import LoraConfig, get_peft_model

    from tests._hf import build

    def lora_model() -> torch.nn.Module:
        torch.manual_seed(3)
        model = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.1)  # B starts at zero: make the merge change something
        return model

    plain = lora_model()
    for layer in plain.modules():
        if hasattr(layer, "merge") and hasattr(layer, "lora_A"):
            layer.merge()
    expected = {k: v for k, v in plain.state_dict().items() if "lora_" not in k}
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        model = zeroinf.shard(lora_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
        for layer in model.modules():
            if hasattr(layer, "merge") and hasattr(layer, "lora_A"):
                with zeroinf.gathered(list(layer.parameters()), modify=True, modifier_rank=0):
                    layer.merge()
        got = model.state_dict()
        out[stage] = [k for k, v in expected.items() if not torch.equal(got[k], v)]
    return out


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        "frozen": _frozen_outside_units(rank, world, root),
        "round_trip": _round_trip(rank, world, root), "bf16": _bf16_masters(rank, world, root),
        "inside": _forwards_inside(rank, world, root), "penalty": _penalty(rank, world, root, None),
        "penalty_clipped": _penalty(rank, world, root, 0.05), "through_block": _through_block(rank, world, root),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-gathered-") as root:
        return run_ranks(run, 2, root, timeout_s=240)


def test_writes_reach_every_rank_the_tier_and_the_masters(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        t = r["round_trip"]
        assert t["shape_inside"] == (64, 32) and t["nested_read_shape"] == (32, 64), (rank, t)
        assert t["shape_after"] == (0, 0), (rank, t)
        assert t["state_has_new"] and t["forward_matches_plain"], (rank, t)
        assert t["survives_step"], f"rank {rank}: the write did not reach the fp32 masters"
        assert t["modifier_rank_value"] == [1.0], (rank, t)


def test_nested_write_is_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "already gathered for writing" in r["round_trip"]["nested_write_error"]


def test_bf16_masters_of_untouched_elements_keep_fp32(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        b = r["bf16"]
        assert b["unrounded_before"], "the masters should hold unrounded fp32 values to begin with"
        assert b["changed"] == b["owned_row"], f"rank {rank}: masters changed outside the written row: {b}"
        assert b["row_masters"] in ([], [0.25]), (rank, b)


def test_parameters_of_an_unsharded_model_are_refused() -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"belongs to no sharded model.*zeroinf.shard"):
        with zeroinf.gathered(model.head.weight):
            pass


def test_parked_parameters_can_be_edited_before_shard() -> None:
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    with zeroinf.init(cfg):
        model = Net()
    head = model.head.weight
    assert head.is_meta
    with zeroinf.gathered(head, modify=True):
        assert not head.is_meta
        reference = copy.deepcopy(head.detach())
        head.mul_(-1)
    assert head.is_meta
    zeroinf.shard(model, cfg)
    assert torch.equal(model.state_dict()["head.weight"], -reference)


@pytest.mark.parametrize("params", ["nvme", "device"])
def test_a_write_waits_for_a_background_save(tmp_path: Any, params: str) -> None:
    """A `gathered(modify=True)` right after `save(blocking=False)` waits for the save's writes: the
    checkpoint holds the weights and masters from before the write (its writer reads the masters, in
    the parameter file with `params="nvme"`, in the shard itself with `params="device"`)."""
    def build(swap: str) -> tuple[torch.nn.Module, zeroinf.AdamW]:
        offload = zeroinf.OffloadConfig(params=params, optimizer="nvme" if params == "nvme" else "device",
                                        nvme_dir=str(tmp_path / swap))
        torch.manual_seed(0)
        model = zeroinf.shard(Net(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
        return model, zeroinf.AdamW(model, lr=1e-2)

    model, opt = build("swap")
    _step(model, opt, torch.arange(8).view(2, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pending = zeroinf.save(tmp_path / "ckpt", model, opt, step=1, blocking=False)
    engine = zeroinf.engine_of(model)
    assert engine.pending_save is pending
    with zeroinf.gathered(model.blocks[2].up.weight, modify=True) as (weight,):
        assert engine.pending_save is None and opt.pending_save is None  # finished first
        weight.fill_(3.0)
    assert torch.equal(model.state_dict()["blocks.2.up.weight"], torch.full_like(before["blocks.2.up.weight"], 3.0))
    resumed, resumed_opt = build("swap2")
    zeroinf.load(tmp_path / "ckpt", resumed, resumed_opt)
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, before[key]), key
    for opt_ in (opt, resumed_opt):
        opt_.close()


def test_forwards_inside_a_block_keep_its_units(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        t = r["inside"]
        assert t["inside_matches_plain"] and t["held_after_forward"] == (64, 32), (rank, t)
        assert t["write_kept"], f"rank {rank}: the forward inside the block lost its write"
        assert t["gathers_inside"] == 0 and t["same_outputs"], (rank, t)


def test_a_penalty_over_parameters_trains_inside_a_block_and_is_explained_outside(
    results: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(results):
        for case in ("penalty", "penalty_clipped"):
            t = r[case]
            assert t["ours"] == pytest.approx(t["plain"], rel=1e-6), (case, rank, t["ours"], t["plain"])
            assert t["weights_diff"] < 1e-6, (case, rank, t["weights_diff"])
            assert t["refreshes_in_flight"] == [], (case, rank, t["refreshes_in_flight"])
            assert "empty placeholder" in t["outside_error"] and "zeroinf.gathered" in t["outside_error"], t
        # clipping triggered: each speculative step was undone and redone (the second store of a
        # unit in one step refreshed its whole copy with the first one's values before the fix)
        assert r["penalty_clipped"]["rollbacks"] >= 1, r["penalty_clipped"]["rollbacks"]


def test_training_through_a_block_is_bitwise_training_without_it(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        for name, t in r["through_block"].items():
            assert t["same_losses"] and t["same_weights"], (rank, name, t)
        assert r["through_block"]["nvme-clip"]["rollbacks"] >= 1, r["through_block"]


def test_a_lora_merge_gathers_adapters_and_frozen_base_at_every_stage(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["frozen"] == {0: [], 1: [], 2: [], 3: []}, (rank, r["frozen"])



@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_wgan_weight_clipping_inside_gathered_trains_as_plain_pytorch(stage: int) -> None:
    """WGAN clamps every weight after each step; inside zeroinf.gathered(modify=True) the clamp
    reaches the shards and the fp32 masters: bitwise the plain loop (README, docs/migrating-from-ddp.md)."""
    from tests._parity import LR, build_model, wgan_clipping_matches_plain

    model = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=LR)

    def clip() -> None:
        with zeroinf.gathered(list(model.parameters()), modify=True):
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)

    try:
        assert wgan_clipping_matches_plain(model, opt, clip)
    finally:
        zeroinf.engine_of(model).close()
