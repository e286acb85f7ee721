"""LoRA on a base loaded by `zeroinf.from_pretrained` (stage 3, base on NVMe) against plain PyTorch + peft.

The reference: `AutoModelForCausalLM.from_pretrained` + `get_peft_model`, `torch.optim.AdamW` over the
adapters, the whole global batch in one process. zeroinf: `from_pretrained(path, cfg,
prepare=get_peft_model)` at world 2, each rank its half of every batch. Losses and adapter weights
within the foundation's fp32 tolerances (tests/test_parity.py: rtol 1e-5, atol 5e-5). The ledger:
optimizer states exist only for the adapters (12 bytes per adapter element, halved by sharding), and
each rank's NVMe holds half of every sharded base unit (the root: embeddings, final norm and head,
stays resident on the device, as every stage-3 root does).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._hf import rank_rows, train_causal_lm
from tests.partition._construction import VOCAB, build

STEPS, GLOBAL_BATCH, LR = 4, 4, 1e-2


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, 16), generator=torch.Generator().manual_seed(step))


def _reference(path: str) -> tuple[list[float], dict[str, torch.Tensor], tuple[int, int]]:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), _lora())
    counts = model.get_nb_trainable_parameters()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        x = _batch(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, counts


def _zeroinf(rank: int, world: int, path: str, swap_root: str) -> dict[str, Any]:
    from peft import get_peft_model

    swap = os.path.join(swap_root, f"rank{rank}")
    os.makedirs(swap, exist_ok=True)
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0, offload=zeroinf.OffloadConfig(params="nvme", nvme_dir=swap)
    )
    torch.manual_seed(0)  # the adapters draw the same numbers as the reference's
    model = zeroinf.from_pretrained(path, cfg, prepare=lambda m: get_peft_model(m, _lora()))
    model.train()
    engine = zeroinf.engine_of(model)
    opt = zeroinf.AdamW(model, lr=LR)
    losses = train_causal_lm(model, opt, lambda step: rank_rows(_batch(step), rank, world), STEPS, world)
    report = zeroinf.memory_report(model)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {
        "losses": losses,
        "trainable_numel": sum(u.layout.padded_numel for u in engine.units),
        "frozen_sharded_numel": sum(u.layout.padded_numel for u in engine.frozen_units if not u.resident),
        "frozen_units": len(engine.frozen_units),
        "optimizer_bytes": sum(report[t]["by_tag"].get("optimizer_state", 0) for t in ("device", "host", "nvme")),
        "nvme_param_bytes": report["nvme"]["by_tag"].get("param_shard", 0),
        "adapter_names": sorted(adapters),
        "peft_counts": model.get_nb_trainable_parameters(),  # (trainable, all), between uses
        "sharded_shapes_told": all(
            tuple(p.ds_shape) == tuple(s) for u in engine.all_units if not u.resident
            for p, s in zip(u.params, (slot.shape for slot in u.layout.slots), strict=True)
        ),
    }
    state = model.state_dict()
    out["adapters"] = {n: state[n].clone() for n in adapters} if rank == 0 else None
    opt.close()
    engine.close()
    return out


@pytest.fixture(scope="module")
def run() -> tuple[tuple[list[float], dict[str, torch.Tensor], tuple[int, int]], list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-lora-") as root:
        path = os.path.join(root, "llama")
        build("llama", seed=5).save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
        return _reference(path), run_ranks(_zeroinf, 2, path, root, timeout_s=300)


def test_lora_matches_plain_pytorch_and_peft(run: tuple) -> None:
    (ref_losses, ref_adapters, _), per_rank = run
    ours = per_rank[0]
    for step, (a, b) in enumerate(zip(ours["losses"], ref_losses, strict=True)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {a} vs {b}"
    assert sorted(ref_adapters) == ours["adapter_names"]
    for name, ref in ref_adapters.items():
        torch.testing.assert_close(ours["adapters"][name], ref, rtol=1e-5, atol=5e-5, msg=name)


def test_only_adapters_have_optimizer_state_and_the_base_is_sharded(run: tuple) -> None:
    _, per_rank = run
    for rank, r in enumerate(per_rank):
        assert r["frozen_units"] >= 3, r
        # fp32 master + two moments for each adapter element this rank owns, nothing for the base
        assert r["optimizer_bytes"] == 12 * r["trainable_numel"] // 2, (rank, r)
        # NVMe: half of every non-resident unit (fp32 shards), adapters included, base dominating
        assert r["nvme_param_bytes"] >= 4 * (r["frozen_sharded_numel"] + r["trainable_numel"]) // 2, (rank, r)
        assert r["nvme_param_bytes"] < 4 * (r["frozen_sharded_numel"] + r["trainable_numel"]) // 2 + 4096 * 8, r


def test_peft_counts_the_full_sizes_of_sharded_parameters(run: tuple) -> None:
    """Between uses a sharded parameter's data is an empty placeholder; PEFT reads `ds_numel` (and its
    tuners `ds_shape`) for the real size, as it does under DeepSpeed's ZeRO-3: before, it counted
    0 trainable parameters."""
    (_, _, ref_counts), per_rank = run
    for rank, r in enumerate(per_rank):
        assert tuple(r["peft_counts"]) == tuple(ref_counts), (rank, r["peft_counts"], ref_counts)
        assert r["peft_counts"][0] > 0 and r["sharded_shapes_told"], (rank, r)
