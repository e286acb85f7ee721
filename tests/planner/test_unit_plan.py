"""The plan's bytes per tier against the engine's ledger after building and training, for many
placements at world 1 and 2, and the unit plan the engine builds from equal to the planner's.

Tolerance: 5% per tier of the ledger's peak over a steady step (`memory_report()["last_step"]`);
the issue asks for 10%, and on these models the prediction is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from zeroinf.models.gpt import GPT, GPTConfig
from zeroinf.planner.api import plan
from zeroinf.planner.model_facts import from_gpt_config
from zeroinf.planner.unit_plan import UnitShape, plan_units

TOLERANCE = 0.05
GPT_CFG = GPTConfig(seq_len=64, n_layer=3, n_head=2, d_model=128)  # blocks of 786 KB: sharded at stage 3
BATCH = 2
Off = dict  # offload fields; the folder is added per test

PLACEMENTS: dict[str, dict[str, Any]] = {
    "stage 0": dict(stage=0),
    "stage 1": dict(stage=1),
    "stage 2, optimizer host": dict(stage=2, offload=Off(optimizer="host")),
    "stage 2, optimizer + grads nvme": dict(stage=2, offload=Off(optimizer="nvme", gradients="nvme")),
    "stage 3 in memory": dict(stage=3),
    "stage 3, optimizer nvme": dict(stage=3, offload=Off(optimizer="nvme")),
    "stage 3, params + optimizer nvme": dict(stage=3, offload=Off(params="nvme", optimizer="nvme")),
    "stage 3, all host": dict(stage=3, offload=Off(params="host", optimizer="host", gradients="host")),
    "stage 3, all nvme, bf16": dict(
        stage=3, param_dtype="bf16", offload=Off(params="nvme", optimizer="nvme", gradients="nvme")
    ),
    "stage 3, checkpointing, offloaded activations": dict(
        stage=3, activation_checkpointing=True, offload_activations=True
    ),
    "stage 3, accumulation 2": dict(stage=3, grad_accum_steps=2),
    "stage 3, optimizer host, bf16 moments": dict(stage=3, offload=Off(optimizer="host", moment_dtype="bf16")),
    "stage 3, params + optimizer nvme, bf16 moments": dict(
        stage=3, offload=Off(params="nvme", optimizer="nvme", moment_dtype="bf16")
    ),
}
WORLD2 = (
    "stage 2, optimizer host", "stage 3 in memory", "stage 3, optimizer nvme", "stage 3, params + optimizer nvme",
    "stage 3, params + optimizer nvme, bf16 moments",
)


def config(name: str, nvme_dir: str) -> zeroinf.Config:
    kw = dict(PLACEMENTS[name])
    if "offload" in kw:
        kw["offload"] = zeroinf.OffloadConfig(**kw["offload"], nvme_dir=nvme_dir)
    return zeroinf.Config(**kw)


def measure(cfg: zeroinf.Config, topo: zeroinf.Topology | None = None) -> tuple[dict[str, int], Any]:
    """Build under zeroinf.init, train two steps; the ledger's peaks of the second, and the unit plan."""
    torch.manual_seed(0)
    with zeroinf.init(cfg, topology=topo):
        model = GPT(GPT_CFG)
    zeroinf.shard(model, cfg, topology=topo)
    opt = zeroinf.AdamW(model, lr=1e-3)
    idx = torch.randint(0, 256, (BATCH, GPT_CFG.seq_len))
    for _ in range(2):
        for _ in range(cfg.grad_accum_steps):
            opt.backward(model(idx, idx) / cfg.grad_accum_steps)
        opt.step()
        opt.zero_grad()
    last = zeroinf.memory_report(model)["last_step"]
    unit_plan = zeroinf.engine_of(model).unit_plan
    opt.close()
    zeroinf.engine_of(model).close()
    return {t: last[t]["peak_bytes"] for t in ("device", "host", "nvme")}, unit_plan


def predicted(cfg: zeroinf.Config, world: int) -> dict[str, int]:
    e = plan(
        from_gpt_config(GPT_CFG), cfg, world_size=world, seq_len=GPT_CFG.seq_len,
        tokens_per_step=BATCH * GPT_CFG.seq_len * world * cfg.grad_accum_steps,
    ).estimates[0]
    return {t: e.ledger.of(t) for t in ("device", "host", "nvme")}


def assert_close(pred: dict[str, int], meas: dict[str, int], what: str) -> None:
    for tier in ("device", "host", "nvme"):
        assert abs(pred[tier] - meas[tier]) <= TOLERANCE * max(meas[tier], 1), (
            f"{what}, {tier}: predicted {pred[tier]} bytes, the ledger counted {meas[tier]}"
        )


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_predicted_bytes_per_tier_match_the_ledger_world_1(name: str, tmp_path: Path) -> None:
    cfg = config(name, str(tmp_path))
    meas, built = measure(cfg)
    assert_close(predicted(cfg, 1), meas, name)
    # The engine built from the same per-unit plan the planner estimates from.
    assert built == plan_units(from_gpt_config(GPT_CFG).units_for(cfg), cfg, 1)


def _world2(rank: int, world: int, nvme_dir: str) -> dict[str, Any]:
    out = {}
    for name in WORLD2:
        cfg = config(name, nvme_dir)
        meas, _ = measure(cfg, zeroinf.Topology.current())
        out[name] = (meas, predicted(cfg, world))
    return out


def test_predicted_bytes_per_tier_match_the_ledger_world_2(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_world2, 2, str(tmp_path), timeout_s=300)):
        for name, (meas, pred) in result.items():
            assert_close(pred, meas, f"{name}, rank {rank} of 2")


def test_frozen_units_are_planned_without_gradients_or_optimizer_state(tmp_path: Path) -> None:
    cfg = zeroinf.Config(
        stage=3, offload=zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path))
    )
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    for block in model.blocks[:2]:
        block.requires_grad_(False)
    zeroinf.shard(model, cfg)
    opt = zeroinf.AdamW(model, lr=1e-3)
    idx = torch.randint(0, 256, (BATCH, GPT_CFG.seq_len))
    for _ in range(2):
        opt.backward(model(idx, idx))
        opt.step()
        opt.zero_grad()
    engine = zeroinf.engine_of(model)
    unit_plan = engine.unit_plan
    assert [u.swap_key for u in unit_plan.units] == [u.name for u in engine.all_units]
    frozen = [u for u in unit_plan.units if u.frozen]
    assert len(frozen) == 2 and all(u.owned_numel == 0 for u in frozen)
    assert all(k[0] in {u.swap_key for u in unit_plan.trainable_units} for k in unit_plan.grad_swap_bytes())
    from zeroinf.planner.api import predict_built

    e = predict_built(engine, from_gpt_config(GPT_CFG), BATCH * GPT_CFG.seq_len, GPT_CFG.seq_len)
    last = zeroinf.memory_report(model)["last_step"]
    assert_close({t: e.ledger.of(t) for t in ("device", "host", "nvme")},
                 {t: last[t]["peak_bytes"] for t in ("device", "host", "nvme")}, "frozen blocks")
    opt.close()
    engine.close()


def test_unit_shapes_of_a_meta_model_equal_the_built_ones() -> None:
    from zeroinf.partition.wrap import discover_units

    with torch.device("meta"):
        meta = GPT(GPT_CFG)
    real = GPT(GPT_CFG)
    assert [UnitShape.of(s) for s in discover_units(meta)] == [UnitShape.of(s) for s in discover_units(real)]


def test_plan_units_refuses_auto_fields_and_bad_world() -> None:
    units = from_gpt_config(GPT_CFG).units
    with pytest.raises(ValueError, match="concrete Config"):
        plan_units(units, zeroinf.Config(stage="auto"), 1)
    with pytest.raises(ValueError, match="world_size = 0"):
        plan_units(units, zeroinf.Config(stage=3), 0)


def test_a_frozen_twins_backward_step_keeps_its_blocks_activations() -> None:
    """LoRA: a block is a trainable unit and a frozen unit of the same name. At the frozen unit's
    backward step the activations of its block and those before it are alive, as at its trainable
    twin's step (not only the root's)."""
    from zeroinf.planner.estimate import _stage3_timeline, activations_alive
    from zeroinf.planner.model_facts import from_gpt_config
    from zeroinf.planner.unit_plan import UnitShape, plan_units

    facts = from_gpt_config(GPT_CFG).pass_facts(BATCH, GPT_CFG.seq_len, "fp32", torch.device("cpu"))
    assert facts is not None
    blocks = [f"blocks.{i}" for i in range(GPT_CFG.n_layer)]
    units = [UnitShape(b, ((f"{b}.lora", (64, 4)),)) for b in blocks]
    units += [UnitShape("", (("head.weight", (256, 64)),))]
    units += [UnitShape(b, ((f"{b}.weight", (512, 512)),), frozen=True) for b in blocks]
    plan = plan_units(units, zeroinf.Config(stage=3, persist_threshold_bytes=0), 1)
    alive = activations_alive(plan, facts)
    assert alive is not None
    steps = zip(_stage3_timeline(plan), alive, strict=True)
    by_unit = {(plan.units[w].name, plan.units[w].frozen): a for (w, _), a in steps if w >= 0}
    for k, block in enumerate(blocks):
        expected = facts.root_saved_bytes + sum(facts.unit_saved_bytes[: k + 1])
        assert by_unit[(block, True)] == by_unit[(block, False)] == expected, block


def test_parameter_staging_comes_in_size_classes_for_a_lora_model(tmp_path: Path) -> None:
    """A LoRA model's adapter units are a fraction of its frozen base layers: staging buffers the size
    of the largest shard, counted by the small units that fit the prefetch budget together, made 3.0
    GB of staging for a 2.2 GB model (planner/unit_plan.py [Note: staging by size class]). Each class
    now has buffers of its own size; the engine holds what the plan says, and training matches peft."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from tests._hf import build

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))

    def lora_llama() -> torch.nn.Module:
        model = build("llama")
        torch.manual_seed(1)
        return get_peft_model(model, lora)

    offload = zeroinf.OffloadConfig(params="nvme", optimizer="host", nvme_dir=str(tmp_path))
    model = zeroinf.shard(lora_llama(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    engine = zeroinf.engine_of(model)
    staging = engine.unit_plan.param_staging()
    (small, small_count), (large, large_count) = staging.classes
    assert 4 * small < large and small_count >= 2 and large_count >= 2, staging
    assert staging.total_bytes < staging.count * large  # what buffers all of the largest size held
    opt = zeroinf.AdamW(model, lr=1e-2)
    plain = lora_llama()
    plain_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        plain_loss = plain(input_ids=ids, labels=ids).loss
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-5)
    assert zeroinf.memory_report(model)["host"]["by_tag"]["param_staging"] == staging.total_bytes
    opt.close()
    engine.close()
