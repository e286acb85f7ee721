"""`Config.cast_forward_inputs`: floating-point inputs reach a bf16/fp16 model in its compute dtype.

An fp32 input met bf16 weights with "mat1 and mat2 must have the same dtype" before; FSDP2 casts
the inputs by default. Oracle: the same model and config with the caller casting the inputs by
hand (and the cast off): bitwise the same losses, weights and input gradients, at stages 0 and 3.
Integer inputs (token ids, labels) keep their dtype; nested dicts and lists are cast; an input
that requires grad gets its gradient back in fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroinf


class Regressor(nn.Module):
    """Float features in a nested dict, an integer class index, a float weight list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 8)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)
        self.seen: list[torch.dtype] = []

    def forward(self, batch: dict[str, Any], scale: list[torch.Tensor]) -> torch.Tensor:
        self.seen = [batch["features"].dtype, batch["kind"].dtype, scale[0].dtype]
        h = self.a(batch["features"] + self.embed(batch["kind"]))
        return (self.b(torch.relu(h)) * scale[0]).float().pow(2).mean()


def _inputs(step: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    features = torch.randn(6, 8, generator=g).requires_grad_(True)
    return {"features": features, "kind": torch.randint(0, 5, (6,), generator=g)}, [torch.full((1,), 0.5)]


def _train(stage: int, dtype: str, automatic: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = zeroinf.Config(stage=stage, param_dtype=dtype, cast_forward_inputs=automatic, persist_threshold_bytes=0)
    model = zeroinf.shard(Regressor(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    low = cfg.param_torch_dtype
    losses = []
    for step in range(3):
        batch, scale = _inputs(step)
        if not automatic:  # what a caller had to do before
            batch = {**batch, "features": batch["features"].to(low)}
            scale = [s.to(low) for s in scale]
        loss = model(batch, scale)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "seen": model.seen, "weights": model.state_dict()}


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_floating_inputs_are_cast_as_the_caller_would(stage: int, dtype: str) -> None:
    auto, by_hand = _train(stage, dtype, True), _train(stage, dtype, False)
    low = zeroinf.Config(param_dtype=dtype).param_torch_dtype
    assert auto["seen"] == [low, torch.int64, low]
    assert auto["losses"] == by_hand["losses"]
    for name, value in by_hand["weights"].items():
        assert torch.equal(auto["weights"][name], value), name


def test_an_input_that_requires_grad_gets_an_fp32_gradient() -> None:
    torch.manual_seed(0)
    model = zeroinf.shard(Regressor(), zeroinf.Config(stage=3, param_dtype="bf16", persist_threshold_bytes=0))
    batch, scale = _inputs(0)
    torch.manual_seed(0)
    by_hand = zeroinf.shard(
        Regressor(), zeroinf.Config(stage=3, param_dtype="bf16", cast_forward_inputs=False, persist_threshold_bytes=0)
    )
    hand_features = batch["features"].detach().to(torch.bfloat16).requires_grad_(True)
    model(batch, scale).backward()  # a frozen-free model without an optimizer: plain backward is fine in bf16
    by_hand({"features": hand_features, "kind": batch["kind"]}, [scale[0].to(torch.bfloat16)]).backward()
    grad = batch["features"].grad
    assert grad is not None and grad.dtype == torch.float32
    assert torch.equal(grad, hand_features.grad.float())


def test_off_or_fp32_passes_inputs_as_given() -> None:
    torch.manual_seed(0)
    off = zeroinf.shard(Regressor(), zeroinf.Config(stage=0, param_dtype="bf16", cast_forward_inputs=False))
    batch, scale = _inputs(0)
    with pytest.raises(RuntimeError, match="dtype"):
        off(batch, scale)  # what an fp32 input meets without the cast
    torch.manual_seed(0)
    fp32 = zeroinf.shard(Regressor(), zeroinf.Config(stage=0))
    fp32(batch, scale)
    assert fp32.seen == [torch.float32, torch.int64, torch.float32]
