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


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_conversion_after_shard_is_refused_before_the_forward(stage: int) -> None:
    """`model.to(torch.bfloat16)` after `shard` gave the parameters storage of their own: at stages
    0-2 training went on and no weight ever changed, at stage 3 the forward failed on mixed dtypes."""
    torch.manual_seed(0)
    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    zeroinf.AdamW(model, lr=1e-2)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"the model was converted after zeroinf\.shard .* Convert before"):
        model(*global_batch(0))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_parameter_given_a_tensor_of_its_own_after_shard_is_refused(stage: int) -> None:
    """`p.data = t` on any parameter of a unit (not only its first, which the conversion check reads):
    the parameter kept the assigned values forever while the optimizer stepped the buffer it had been
    a view of, silently."""
    torch.manual_seed(0)
    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-2)
    opt.backward(model(*global_batch(0)))
    opt.step()
    unit = zeroinf.engine_of(model).units[0]
    name, p = unit.param_names[1], unit.params[1]  # not the first of its unit
    p.data = torch.full_like(p, 0.5)
    with pytest.raises(RuntimeError, match=rf"parameter {name} was given a tensor of its own .* zeroinf\.gathered"):
        model(*global_batch(1))
    with zeroinf.gathered([p], modify=True):  # the fix the message names: written in place, kept
        p.copy_(torch.full_like(p, 0.5))
    opt.backward(model(*global_batch(1)))
    opt.step()
    assert not bool((p == 0.5).all()), "the parameter trains again"


def test_a_conversion_to_what_the_engine_holds_changes_nothing() -> None:
    torch.manual_seed(0)
    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=2))
    opt = zeroinf.AdamW(model, lr=1e-2)
    model.float().to("cpu")  # fp32 on the CPU already: PyTorch keeps the same tensors
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt.backward(model(*global_batch(0)))
    opt.step()
    assert all(not torch.equal(before[n], t) for n, t in model.state_dict().items() if "weight" in n)


def test_pickling_or_deep_copying_a_sharded_model_names_what_works() -> None:
    import copy
    import io

    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=3))
    for attempt in (lambda: torch.save(model, io.BytesIO()), lambda: copy.deepcopy(model)):
        with pytest.raises(TypeError, match=r"cannot be pickled or deep-copied .* model\.state_dict\(\) on every rank"):
            attempt()


def test_a_float64_model_is_refused_rather_than_trained_in_fp32() -> None:
    with pytest.raises(TypeError, match=r"pos is float64, .* Convert the model first \(model\.float\(\)\)"):
        zeroinf.shard(TinyGPT().double(), zeroinf.Config(stage=2))


@pytest.mark.parametrize("stage", [0, 3])
def test_parameters_added_after_shard_are_named_at_the_step(stage: int) -> None:
    """A module replaced after `shard` (a new head, `resize_token_embeddings`) is in no unit: no
    optimizer would ever step it, and it used to stay at its initial values without a word."""
    from torch import nn

    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-2)
    model.ln_f = nn.LayerNorm(model.ln_f.normalized_shape)
    opt.backward(model(*global_batch(0)))
    with pytest.raises(RuntimeError, match=r"\['ln_f\.weight', 'ln_f\.bias'\] got gradients, but no zeroinf unit"):
        opt.step()


def _wrapped_in_ddp(rank: int, world: int) -> dict[int, str]:
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
        opt = zeroinf.AdamW(model, lr=1e-2)
        x, y = global_batch(0)
        try:
            opt.backward(DistributedDataParallel(model)(x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]))
            out[stage] = "trained"
        except RuntimeError as exc:
            out[stage] = str(exc)
        opt.backward(model(x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]))  # unwrapped: trains
        opt.step()
        zeroinf.engine_of(model).close()
    return out


def test_a_ddp_wrapper_around_the_sharded_model_is_refused_at_its_forward() -> None:
    """Out of DDP habit, `DistributedDataParallel(model)` after `shard`: at stages 0-2 a second reducer
    all-reduced every gradient beside the engine's, at stage 3 backward failed on the placeholders'
    shapes ("AddmmBackward0 returned an invalid gradient"). Refused at the forward, world 2."""
    from tests._harness import run_ranks

    for out in run_ranks(_wrapped_in_ddp, 2, timeout_s=120):
        for stage, message in out.items():
            assert "runs inside torch.nn.parallel.DistributedDataParallel" in message, (stage, message)
            assert "without the DDP wrapper" in message


def test_distributed_checkpoint_optimizer_state_is_refused_naming_zeroinf_save() -> None:
    """torch.distributed.checkpoint's get_optimizer_state_dict creates an empty optimizer's state by
    putting zeros in every p.grad and stepping: zeroinf's states are not in optimizer.state, and that
    step met "optimizer.step() after 0 backward passes"; now the message names zeroinf.save. The
    model's weights go through DCP's get_/set_model_state_dict unchanged."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    torch.manual_seed(0)
    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-2)
    try:
        opt.backward(model(*global_batch(0)))
        opt.step()
        opt.zero_grad()
        state = {k: v.clone() for k, v in get_model_state_dict(model).items()}
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        torch.manual_seed(1)
        other = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=3, persist_threshold_bytes=0))
        set_model_state_dict(other, state)
        assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())
        zeroinf.engine_of(other).close()
        with pytest.raises(RuntimeError, match=r"without a backward pass.*zeroinf\.save / zeroinf\.load"):
            get_optimizer_state_dict(model, opt)
    finally:
        zeroinf.engine_of(model).close()


def _dcgan(shard: bool, stage: int, step_in_backward: object) -> list[torch.Tensor]:
    """PyTorch's DCGAN example loop (netD.zero_grad(), the module's), on two small MLPs."""
    torch.manual_seed(0)
    net_g = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    net_d = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if shard:
        cfg = {"stage": stage, "persist_threshold_bytes": 0, "offload": {"step_in_backward": step_in_backward}}
        net_g, net_d = zeroinf.shard(net_g, cfg), zeroinf.shard(net_d, cfg)
        opt_g, opt_d = zeroinf.AdamW(net_g.parameters(), lr=1e-2), zeroinf.AdamW(net_d.parameters(), lr=1e-2)
    else:
        opt_g = torch.optim.AdamW(net_g.parameters(), lr=1e-2, fused=True)
        opt_d = torch.optim.AdamW(net_d.parameters(), lr=1e-2, fused=True)
    bce = torch.nn.BCEWithLogitsLoss()
    try:
        for it in range(3):
            g = torch.Generator().manual_seed(it)
            real, noise = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            net_d.zero_grad()
            (bce(net_d(real), torch.ones(8, 1)) + bce(net_d(net_g(noise).detach()), torch.zeros(8, 1))).backward()
            opt_d.step()
            net_g.zero_grad()
            bce(net_d(net_g(noise)), torch.ones(8, 1)).backward()  # also reaches the discriminator
            opt_g.step()
        return [t.clone() for m in (net_g, net_d) for t in m.state_dict().values()]
    finally:
        if shard:
            zeroinf.engine_of(net_g).close()
            zeroinf.engine_of(net_d).close()


@pytest.mark.parametrize("stage", [0, 3])
def test_model_zero_grad_discards_what_the_engine_holds_as_in_pytorch(stage: int) -> None:
    """nn.Module.zero_grad cleared only p.grad, where the engine keeps nothing: a DCGAN loop, whose
    netD.zero_grad() discards what the generator's backward left in the discriminator, stopped with
    "backward pass 2 since the last optimizer step". Now model.zero_grad() discards as PyTorch does
    (bitwise the plain loop with the step after backward) or, where the generator's backward already
    stepped the discriminator inside it, says so and names step_in_backward."""
    plain = _dcgan(False, stage, None)
    assert all(torch.equal(a, b) for a, b in zip(_dcgan(True, stage, False), plain, strict=True))
    with pytest.raises(RuntimeError, match=r"model\.zero_grad\(\) after a backward that already stepped"):
        _dcgan(True, stage, "auto")


class _Stateful(torch.nn.Module):
    """Buffers of every kind and a frozen layer beside two trained blocks, all drawn from the seed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.register_buffer("projection", torch.randn(8, 8))
        self.register_buffer("table", torch.randn(8), persistent=False)
        self.register_buffer("mask", torch.rand(8) > 0.5)
        self.register_buffer("counts", torch.randint(0, 100, (3,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return ((x + self.frozen(x)) @ self.projection + self.table * self.mask).sum()


def _built_from_each_ranks_seed(rank: int, world: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for stage in (0, 1, 3):
        torch.manual_seed(rank)  # a script that seeds by rank, or forgot to seed
        model = zeroinf.shard(_Stateful(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
        out[stage] = {**{k: v.clone() for k, v in model.state_dict().items()}, "table": model.table.clone()}
        zeroinf.engine_of(model).close()
    return out


def test_every_rank_starts_from_the_first_ranks_buffers_and_frozen_parameters() -> None:
    """As DDP's constructor and FSDP's sync_module_states: ranks that built the model from other
    seeds hold rank 0's values after `shard`, the buffers (persistent or not, float, bool, int) and
    the frozen parameters outside units (stages 0-1) too. Before, only the units' parameters were
    broadcast: each rank trained rank 0's weights with its own buffers."""
    from tests._harness import run_ranks

    torch.manual_seed(0)
    expected = _Stateful()
    first = {**expected.state_dict(), "table": expected.table}
    for per_rank in run_ranks(_built_from_each_ranks_seed, 2, timeout_s=120):
        for stage, state in per_rank.items():
            assert state.keys() == first.keys()
            differing = [k for k, v in first.items() if not torch.equal(state[k], v)]
            assert not differing, f"stage {stage}: {differing} are not rank 0's"
