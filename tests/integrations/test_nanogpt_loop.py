"""nanoGPT's DDP training loop, ported to zeroinf by the lines docs/migrating-from-ddp.md shows.

`_train` is nanoGPT's `train.py` loop reduced to its parts that touch the model and optimizer:
`configure_optimizers` (decay/no-decay groups from `named_parameters()`, `fused=True`), a
bf16 autocast context, a disabled `GradScaler` driving `backward`/`unscale_`/`step`/`update`,
`model.require_backward_grad_sync` on every micro-step, `clip_grad_norm_` before the step, the
learning rate set by hand each iteration, `raw_model` for the weights, and evaluation under
`no_grad` (on the master process only, as nanoGPT does, where the stage allows it).

Ported: `DDP(model)` becomes `zeroinf.shard(model, cfg)`, `torch.optim.AdamW` (inside
`configure_optimizers`) becomes `zeroinf.AdamW`, `raw_model` is the model itself. Nothing else.
World 2, stages 1, 2 and 3 (stage 3: evaluation on every rank, since a forward gathers parameters):
the losses, the clipping norms and the final weights equal the DDP run's within 2e-5 (both under
the same autocast; the reductions add in another order).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroinf
from tests._harness import run_ranks
from tests._parity import TinyGPT, global_batch

ITERS, ACCUM, GRAD_CLIP = 4, 2, 0.5


def configure_optimizers(model: nn.Module, adamw: type, weight_decay: float, lr: float) -> Any:
    """nanoGPT's GPT.configure_optimizers, its optimizer class as the one argument that changes."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    nodecay = [p for p in params.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
    return adamw(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def get_lr(it: int) -> float:
    return 6e-4 * 0.5 * (1 + math.cos(math.pi * it / ITERS))


def _train(rank: int, world: int, port: bool, stage: int) -> dict[str, Any]:
    ddp, master_process = world > 1, rank == 0
    torch.manual_seed(1337)
    model: nn.Module = TinyGPT()
    if port:
        cfg = {"stage": stage, "grad_accum_steps": ACCUM, "grad_clip_norm": GRAD_CLIP, "persist_threshold_bytes": 0}
        model = zeroinf.shard(model, cfg)
        optimizer = configure_optimizers(model, zeroinf.AdamW, 0.1, 6e-4)
        raw_model = model
    else:
        optimizer = configure_optimizers(model, torch.optim.AdamW, 0.1, 6e-4)
        model = nn.parallel.DistributedDataParallel(model)
        raw_model = model.module
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only for float16
    ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    per = 8 // world // ACCUM
    losses, norms, evals = [], [], []
    for it in range(ITERS):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        if master_process or stage == 3:  # estimate_loss: nanoGPT evaluates on the master only
            model.eval()
            with torch.no_grad(), ctx:
                evals.append(model(*global_batch(100)).item())
            model.train()
        x, y = global_batch(it)
        rows = slice(rank * per * ACCUM, (rank + 1) * per * ACCUM)
        x, y = x[rows], y[rows]
        for micro_step in range(ACCUM):
            if ddp:
                model.require_backward_grad_sync = micro_step == ACCUM - 1
            with ctx:
                loss = model(x[micro_step * per : (micro_step + 1) * per], y[micro_step * per : (micro_step + 1) * per])
                loss = loss / ACCUM
            scaler.scale(loss).backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        scaler.unscale_(optimizer)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    weights = {k: v.clone() for k, v in raw_model.state_dict().items()}
    if port:
        zeroinf.engine_of(model).close()
    return {"losses": losses, "norms": norms, "evals": evals, "weights": weights}


def _runs(rank: int, world: int) -> dict[str, Any]:
    out = {"ddp": _train(rank, world, port=False, stage=0)}
    out.update({f"zeroinf-{stage}": _train(rank, world, port=True, stage=stage) for stage in (1, 2, 3)})
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_runs, 2, timeout_s=240)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_ported_nanogpt_loop_trains_as_the_ddp_loop(results, stage: int) -> None:
    for rank, runs in enumerate(results):
        ddp, ported = runs["ddp"], runs[f"zeroinf-{stage}"]
        where = (rank, stage)
        assert ported["losses"] == pytest.approx(ddp["losses"], abs=2e-5), where
        assert ported["norms"] == pytest.approx(ddp["norms"], abs=2e-5), where
        assert any(n > GRAD_CLIP for n in ddp["norms"]), "clipping must trigger for the test to see it"
        if rank == 0:
            assert ported["evals"] == pytest.approx(ddp["evals"], abs=2e-5), where
        worst = max((ported["weights"][k] - v).abs().max().item() for k, v in ddp["weights"].items())
        assert worst <= 2e-5, (where, worst)


def test_the_guide_shows_the_lines_this_test_changes() -> None:
    """docs/migrating-from-ddp.md states the port this test runs."""
    text = (Path(__file__).parents[2] / "docs" / "migrating-from-ddp.md").read_text()
    for line in ("model = zeroinf.shard(model, {", "optimizer = zeroinf.AdamW(optim_groups", "raw_model = model\n",
                 "require_backward_grad_sync", "clip_grad_norm_", "enabled=False"):
        assert line in text, line
