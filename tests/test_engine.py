"""Engine misuse that would otherwise train nothing, silently: each stops with the fix named."""

from __future__ import annotations

import pytest
import torch

import zeroinf
from tests._parity import TinyGPT, global_batch


@pytest.mark.parametrize("stage", [0, 3])
def test_a_torch_optimizer_over_model_parameters_is_named_at_the_next_backward(stage: int) -> None:
    torch.manual_seed(0)
    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=stage))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = global_batch(0)
    model(x, y).backward()
    opt.step()  # finds no gradient in any p.grad: a no-op
    opt.zero_grad()
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    with pytest.raises(RuntimeError, match=r"no zeroinf optimizer steps it: build the optimizer with zeroinf\.AdamW"):
        model(x, y).backward()


def test_a_backward_beyond_grad_accum_steps_asks_for_the_step() -> None:
    torch.manual_seed(0)
    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=2, grad_accum_steps=2))
    opt = zeroinf.AdamW(model, lr=1e-2)
    x, y = global_batch(0)
    for _ in range(2):
        opt.backward(model(x, y))
    with pytest.raises(RuntimeError, match=r"backward pass 3 since the last optimizer step, but grad_accum_steps is 2"):
        opt.backward(model(x, y))
