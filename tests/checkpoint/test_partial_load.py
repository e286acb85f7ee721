"""Loading less than the whole checkpoint (checkpoint/loading.py [Note: loading less than the whole
checkpoint]): `zeroinf.load(path, model)` with no optimizer, and `load_optimizer_states=False`.

Two ranks save a run of 2 steps of SGD with momentum; each case loads it under another stage and
placement and goes on for 2 steps with a new optimizer (zeroinf.AdamW, or Lion over the shards),
either made after a weights-only load or given fresh states by `load_optimizer_states=False`. Both
must match plain PyTorch doing the same (2 steps of SGD, then a new optimizer) to the parity suite's
fp32 tolerances (also at world 3, from the world-2 checkpoint), and each other bit for bit: the new
optimizer starts from the checkpoint's fp32 masters either way. A bf16 model checks that the
masters are the checkpoint's fp32 ones, not the weights cast up. Refusals: a weights-only load into
a model whose optimizer exists, and a whole load into another optimizer (whose message now names
`load_optimizer_states=False`).
"""

from __future__ import annotations

import math
import tempfile
from typing import Any

import pytest
import torch

from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch, train_rank_slices

BATCH, SAVED_STEPS, STEPS = 12, 2, 4
LOADS = {  # name -> (stage, tiers of the loading model, optimizer after the load)
    "s2-host-adamw": (2, {"optimizer": "host", "gradients": "host"}, "adamw"),
    "s3-nvme-adamw": (3, {"params": "nvme", "optimizer": "nvme"}, "adamw"),
    "s1-device-lion": (1, {}, "lion"),
    "s3-host-lion": (3, {"params": "host", "optimizer": "host"}, "lion"),
}


def _new_optimizer(kind: str, model: Any) -> Any:
    import zeroinf

    if kind == "adamw":
        return zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    return zeroinf.ShardedOptimizer(zeroinf.Lion, model.parameters(), lr=LR * 0.1, weight_decay=0.1)


def _shard(stage: int, tiers: dict[str, str], scratch: str, dtype: str = "fp32") -> Any:
    import zeroinf

    offload = dict(tiers)
    if "nvme" in offload.values():
        offload["nvme_dir"] = tempfile.mkdtemp(dir=scratch)
    cfg = zeroinf.Config(stage=stage, param_dtype=dtype, persist_threshold_bytes=0,
                         offload=zeroinf.OffloadConfig(**offload))
    return zeroinf.shard(build_model(), cfg)


def _save(rank: int, world: int, root: str, scratch: str, dtype: str) -> list[float]:
    import zeroinf

    model = _shard(3, {"params": "nvme", "optimizer": "nvme"}, scratch, dtype)
    opt = zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=LR * 10, momentum=0.9)
    losses = train_rank_slices(model, opt, rank, world, 0, SAVED_STEPS, batch=BATCH)
    zeroinf.save(root, model, opt, step=SAVED_STEPS)
    zeroinf.engine_of(model).close()
    return losses


def _run(rank: int, world: int, scratch: str) -> dict[str, Any]:
    import zeroinf

    root, root16 = f"{scratch}/fp32", f"{scratch}/bf16"  # one folder for both ranks
    out: dict[str, Any] = {"saved": _save(rank, world, root, scratch, "fp32")}
    for name, (stage, tiers, kind) in LOADS.items():
        # weights only, then a new optimizer
        model = _shard(stage, tiers, scratch)
        info = zeroinf.load(root, model)
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        opt = _new_optimizer(kind, model)
        weights_only = train_rank_slices(model, opt, rank, world, info["step"], STEPS, batch=BATCH)
        final = {k: v.clone() for k, v in model.state_dict().items()}
        zeroinf.engine_of(model).close()
        # a new optimizer, its states fresh, the checkpoint's masters
        model = _shard(stage, tiers, scratch)
        opt = _new_optimizer(kind, model)
        step = zeroinf.load(root, model, opt, load_optimizer_states=False)["step"]
        lr_kept = opt.param_groups[0]["lr"]
        fresh = train_rank_slices(model, opt, rank, world, step, STEPS, batch=BATCH)
        out[name] = {
            "loaded": loaded, "weights_only": weights_only, "fresh": fresh, "final": final, "lr": lr_kept,
            "same_final": all(torch.equal(v, final[k]) for k, v in model.state_dict().items()),
        }
        zeroinf.engine_of(model).close()
    # bf16: both ways start from the fp32 masters (cast up from bf16 weights they would differ)
    _save(rank, world, root16, scratch, "bf16")
    runs = []
    for weights_only in (True, False):
        model = _shard(3, {"params": "host", "optimizer": "host"}, scratch, "bf16")
        if weights_only:
            zeroinf.load(root16, model)
            opt = _new_optimizer("adamw", model)
        else:
            opt = _new_optimizer("adamw", model)
            zeroinf.load(root16, model, opt, load_optimizer_states=False)
        runs.append(_masters(opt))
        zeroinf.engine_of(model).close()
    out["bf16_masters_equal"] = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    out["bf16_masters"] = runs[0]
    # refusals
    model = _shard(2, {}, scratch)
    opt = _new_optimizer("adamw", model)
    try:
        zeroinf.load(root, model)
        out["refused_live"] = ""
    except ValueError as e:
        out["refused_live"] = str(e)
    try:
        zeroinf.load(root, model, opt)
        out["refused_other"] = ""
    except zeroinf.CheckpointError as e:
        out["refused_other"] = str(e)
    zeroinf.engine_of(model).close()
    return out


def _masters(opt: Any) -> list[torch.Tensor]:
    """This rank's fp32 masters, unit by unit."""
    return [opt.states.read_unit(ui).master.clone() for ui in range(len(opt.engine.units))]


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: SGD with momentum for the saved steps, then a new optimizer."""
    model = build_model()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9)
    losses = []
    for step in range(STEPS):
        if step == SAVED_STEPS:
            import zeroinf

            opt = (torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1) if kind == "adamw"
                   else zeroinf.Lion(model.parameters(), lr=LR * 0.1, weight_decay=0.1))
        x, y = global_batch(step, batch=BATCH)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run_other_world(rank: int, world: int, scratch: str) -> dict[str, Any]:
    """World 3 loads the world-2 checkpoint both ways (shards that do not divide evenly)."""
    import zeroinf

    out = {}
    for weights_only in (True, False):
        model = _shard(3, {"params": "nvme", "optimizer": "host"}, scratch)
        if weights_only:
            step = zeroinf.load(f"{scratch}/fp32", model)["step"]
            opt = _new_optimizer("adamw", model)
        else:
            opt = _new_optimizer("adamw", model)
            step = zeroinf.load(f"{scratch}/fp32", model, opt, load_optimizer_states=False)["step"]
        losses = train_rank_slices(model, opt, rank, world, step, STEPS, batch=BATCH)
        out[weights_only] = {"losses": losses, "final": {k: v.clone() for k, v in model.state_dict().items()}}
        zeroinf.engine_of(model).close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    scratch = str(tmp_path_factory.mktemp("partial"))
    per_rank = run_ranks(_run, 2, scratch, timeout_s=300)
    per_rank[0]["world3"] = run_ranks(_run_other_world, 3, scratch, timeout_s=300)[0]
    return per_rank


@pytest.mark.parametrize("name", list(LOADS))
def test_a_new_optimizer_goes_on_from_the_checkpoint_as_plain_pytorch(results: list[dict[str, Any]], name: str) -> None:
    ref_losses, ref_weights = _reference(LOADS[name][2])
    got = results[0][name]
    losses = results[0]["saved"] + got["weights_only"]
    assert got["fresh"] == got["weights_only"]  # bit for bit, both ways
    assert got["same_final"]
    for a, b in zip(losses, ref_losses, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (losses, ref_losses)
    for n, ref in ref_weights.items():
        torch.testing.assert_close(got["final"][n], ref, rtol=1e-5, atol=5e-5)
    assert got["lr"] == (LR if LOADS[name][2] == "adamw" else LR * 0.1)  # the new optimizer's, not SGD's


def test_another_world_size_goes_on_as_plain_pytorch(results: list[dict[str, Any]]) -> None:
    ref_losses, ref_weights = _reference("adamw")
    for run in results[0]["world3"].values():
        losses = results[0]["saved"] + run["losses"]
        for a, b in zip(losses, ref_losses, strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (losses, ref_losses)
        for n, ref in ref_weights.items():
            torch.testing.assert_close(run["final"][n], ref, rtol=1e-5, atol=5e-5)


def test_a_weights_only_load_gives_the_saved_weights(results: list[dict[str, Any]]) -> None:
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9)
    for step in range(SAVED_STEPS):
        x, y = global_batch(step, batch=BATCH)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    for name in LOADS:
        loaded = results[0][name]["loaded"]
        for n, p in model.named_parameters():
            torch.testing.assert_close(loaded[n], p.detach(), rtol=1e-5, atol=5e-5)


def test_bf16_the_new_optimizer_takes_the_fp32_masters(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["bf16_masters_equal"]
        rounded = [m.to(torch.bfloat16).float() for m in r["bf16_masters"]]
        assert any(not torch.equal(a, b) for a, b in zip(r["bf16_masters"], rounded, strict=True))


def test_refusals_name_the_fix(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "has an optimizer (zeroinf.AdamW): pass it" in r["refused_live"]
        assert "load_optimizer_states=False" in r["refused_other"]
        assert "ShardedOptimizer(SGD)" in r["refused_other"]
