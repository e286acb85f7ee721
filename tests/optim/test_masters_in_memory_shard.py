"""fp32 masters held as the parameter shard in memory (optim/states.py [Note: masters in the memory
shard]; at stages 0-2 in fp32 the owned range of the parameters): where the plan applies it, that
the optimizer's master and the unit's shard are one tensor and the ledger counts it once (12 bytes
per parameter live at stage 3 in memory, as torch.optim's AdamW on fp32 parameters), and bitwise
parity with the same run keeping the two apart (parameters on NVMe): training in bf16 and fp32, a
`zeroinf.gathered` write that leaves the other elements' masters unrounded, a speculative step
inside backward undone by clipping, and a checkpoint round trip. At stages 0-2 in fp32, writes
between steps land in the masters as under DDP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model, global_batch, train_step, wgan_clipping_matches_plain
from zeroinf import OffloadConfig
from zeroinf.memory import Tier
from zeroinf.partition.wrap import discover_units
from zeroinf.planner.unit_plan import UnitShape, plan_units


def _cfg(folder: Path, params: str = "device", optimizer: str = "device", dtype: str = "bf16", **fields: object):
    offload = OffloadConfig(params=params, optimizer=optimizer, nvme_dir=str(folder), **fields)  # type: ignore[arg-type]
    return zeroinf.Config(stage=3, persist_threshold_bytes=0, param_dtype=dtype, offload=offload)  # type: ignore[arg-type]


def _flags(cfg: zeroinf.Config, device_type: str = "cpu") -> tuple[bool, ...]:
    shapes = [UnitShape.of(spec) for spec in discover_units(build_model(), ())]
    return plan_units(shapes, cfg, 1, device_type).masters_in_memory_shard


def test_the_plan_shares_where_master_and_shard_live_in_one_memory(tmp_path: Path) -> None:
    blocks_only = _flags(_cfg(tmp_path))
    assert blocks_only[:-1] == (True,) * (len(blocks_only) - 1) and blocks_only[-1] is False  # bf16 root: whole
    assert all(_flags(_cfg(tmp_path, dtype="fp32")))  # fp32: the resident root's slice is its master too
    assert all(_flags(_cfg(tmp_path, dtype="fp32"), "cuda"))  # both on the accelerator
    assert all(_flags(_cfg(tmp_path, "host", "host", "fp32")))  # a CPU device: host and device are one memory
    assert not any(_flags(_cfg(tmp_path, "host", "host", "fp32"), "cuda"))  # a pinned host shard: copies read it
    assert not any(_flags(_cfg(tmp_path, "device", "host", "fp32"), "cuda"))  # two memories
    assert not any(_flags(_cfg(tmp_path, "nvme", "host")))  # on disk: masters_in_param_file's business
    assert not any(_flags(_cfg(tmp_path, optimizer="nvme")))
    for stage in (0, 1, 2):  # the owned range of the whole buffer is the master, in fp32 only
        assert all(_flags(zeroinf.Config(stage=stage, offload=OffloadConfig(optimizer="device"))))
        assert all(_flags(zeroinf.Config(stage=stage, offload=OffloadConfig(optimizer="host"))))  # a CPU device
        assert all(_flags(zeroinf.Config(stage=stage, offload=OffloadConfig(optimizer="device")), "cuda"))
        assert not any(_flags(zeroinf.Config(stage=stage, offload=OffloadConfig(optimizer="host")), "cuda"))
        assert not any(_flags(zeroinf.Config(stage=stage, param_dtype="bf16")))


def _edit(model: torch.nn.Module) -> None:
    """Overwrite one row of a block's weight through `gathered`: only those elements' masters change."""
    weight = model.blocks[1].fc.weight  # type: ignore[index, union-attr]
    with zeroinf.gathered(weight, modify=True):
        weight[0].fill_(0.125)


def _train(cfg: zeroinf.Config, steps: int, folder: Path | None = None) -> dict:
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    engine = zeroinf.engine_of(model)
    shared = engine.unit_plan.masters_in_memory_shard
    for ui, (unit, views) in enumerate(zip(engine.units, opt.states.states, strict=True)):
        if shared[ui]:  # one tensor: the step updates the shard in place
            assert views.master is unit.home.shard or views.master.data_ptr() == unit.home.shard.data_ptr()
            assert unit.home.shard.dtype == torch.float32
    losses = []
    for step in range(steps):
        losses.append(train_step(model, opt, step))
        if step == 0:
            _edit(model)
    if folder is not None:
        zeroinf.save(folder, model, opt, step=steps)
    state = opt.state_dict()
    out = {
        "losses": losses, "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "masters": [m.clone() for m in state["master"]], "shared": shared,
        "rollbacks": opt.rollbacks, "device": dict(engine.ledger.snapshot()["device"]["by_tag"]),
        "owned": sum(u.layout.padded_numel for u in engine.units), "model": model, "opt": opt,
    }
    return out


def _close(run: dict) -> None:
    run["opt"].close()
    zeroinf.engine_of(run["model"]).close()


def _assert_same(got: dict, ref: dict) -> None:
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    for a, b in zip(got["masters"], ref["masters"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_one_tensor_bitwise_equal_to_keeping_two(tmp_path: Path, dtype: str) -> None:
    ref = _train(_cfg(tmp_path / "ref", params="nvme", dtype=dtype), steps=3)
    got = _train(_cfg(tmp_path / "got", dtype=dtype), steps=3)
    assert not any(ref["shared"][:-1]) and got["shared"][0]  # the blocks: on NVMe in the reference
    _assert_same(got, ref)
    # The edited row's masters are its written values; the rest of the weight kept unrounded masters
    # (in bf16 they differ from their compute-dtype values somewhere).
    unit = zeroinf.engine_of(got["model"]).units[1]
    slot = next(s for s, n in zip(unit.layout.slots, unit.param_names, strict=True) if n.endswith("fc.weight"))
    fc_master = got["masters"][1][slot.offset : slot.end].view(slot.shape)
    if dtype == "bf16":
        assert not torch.equal(fc_master[1:], fc_master[1:].bfloat16().float())
    # The ledger counts each master once: 8 bytes of moments per element, the fp32 shard 4.
    device = got["device"]
    owned = got["owned"]  # world 1: every element is owned, the gaps between parameters too
    root_numel = zeroinf.engine_of(got["model"]).units[-1].layout.padded_numel
    shared_numel = owned - (root_numel if dtype == "bf16" else 0)
    assert device["optimizer_state"] == 12 * owned - 4 * shared_numel
    assert device["optimizer_state"] + device["param_shard"] <= 12 * owned + 4 * (owned - shared_numel) + 64 * 4
    _close(ref)
    _close(got)


def test_speculative_step_undone_by_clipping_and_a_checkpoint_round_trip(tmp_path: Path) -> None:
    def cfg(folder: Path, params: str) -> zeroinf.Config:
        offload = OffloadConfig(params=params, optimizer="host", nvme_dir=str(folder), step_in_backward=True)
        return zeroinf.Config(stage=3, persist_threshold_bytes=0, param_dtype="fp32", grad_clip_norm=0.05,
                              offload=offload)

    ref = _train(cfg(tmp_path / "ref", "nvme"), steps=3, folder=tmp_path / "ckpt_ref")
    got = _train(cfg(tmp_path / "got", "host"), steps=3, folder=tmp_path / "ckpt_got")
    assert all(got["shared"]) and not any(ref["shared"][:-1])
    assert got["rollbacks"] > 0  # clipping triggered: the step inside backward was undone and redone
    _assert_same(got, ref)
    # Resume the shared run from its checkpoint and take one more step beside the original.
    resumed = zeroinf.shard(build_model(seed=7), cfg(tmp_path / "resumed", "host"))
    opt = zeroinf.AdamW(resumed, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    zeroinf.load(tmp_path / "ckpt_got", resumed, opt)
    for model, optimizer in ((got["model"], got["opt"]), (resumed, opt)):
        x, y = global_batch(9)
        loss = model(x, y)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    for (key, a), b in zip(got["model"].state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    opt.close()
    zeroinf.engine_of(resumed).close()
    _close(ref)
    _close(got)


def test_load_weights_replaces_a_shared_master(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = build_model(seed=3)
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if k != "head.weight"},
              str(tmp_path / "model.safetensors"))
    model = zeroinf.shard(build_model(), _cfg(tmp_path / "swap"))
    opt = zeroinf.AdamW(model, lr=LR)
    zeroinf.load_weights(model, tmp_path)
    engine = zeroinf.engine_of(model)
    assert engine.unit_plan.masters_in_memory_shard[0]
    want = {k: v.float() for k, v in source.state_dict().items()}
    masters = opt.state_dict()["master"]
    for unit, master in zip(engine.units, masters, strict=True):  # the fp32 values, not their bf16 rounding
        for slot in unit.layout.slots:
            assert torch.equal(master[slot.offset : slot.end].view(slot.shape), want[slot.name]), slot.name
    with zeroinf.gathered(list(model.parameters())):
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name].bfloat16()), name
    assert Tier.DEVICE.value in zeroinf.memory_report(model)
    opt.close()
    engine.close()


@pytest.mark.parametrize("through", ["data", "no_grad"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_in_fp32_step_the_parameters_themselves(stage: int, through: str) -> None:
    """The master is the owned range of the whole buffer: one tensor, 8 bytes of states per owned
    parameter, and a write between steps, through `p.data` (WGAN's clipping) or the parameter under
    no_grad, lands in the master as under DDP: bitwise the plain loop, no refusal
    (partition/intact.py). bf16 keeps the two apart."""
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=stage))
    engine = zeroinf.engine_of(model)
    opt = zeroinf.AdamW(model, lr=LR)

    def clip() -> None:
        with torch.no_grad():
            for p in model.parameters():
                (p.data if through == "data" else p).clamp_(-0.05, 0.05)

    try:
        owned = sum(u.owned_numel for u in engine.units)
        for unit, views in zip(engine.units, opt.states.states, strict=True):
            assert views.master.data_ptr() == unit.param_flat[unit.owned_start :].data_ptr()
        assert engine.ledger.live_bytes(Tier.DEVICE, "optimizer_state") == 8 * owned
        assert wgan_clipping_matches_plain(model, opt, clip)
    finally:
        engine.close()
    bf16 = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, param_dtype="bf16"))
    try:
        assert not any(zeroinf.engine_of(bf16).unit_plan.masters_in_memory_shard)
    finally:
        zeroinf.engine_of(bf16).close()
