"""Dynamic loss scaling: back off and skip on overflow, grow after clean intervals, stop at the floor."""

from __future__ import annotations

import pytest

from zeroinf.config import LossScaleConfig
from zeroinf.precision import MAX_OVERFLOWS_AT_MIN_SCALE, DynamicLossScaler


def make(**kwargs: float) -> DynamicLossScaler:
    return DynamicLossScaler(LossScaleConfig(**kwargs))  # type: ignore[arg-type]


def test_starts_at_initial_scale() -> None:
    scaler = make(initial_scale=1024.0)
    assert scaler.scale == 1024.0 and scaler.skipped_steps == 0 and scaler.clean_steps == 0


def test_backoff_on_overflow_counts_skipped_steps() -> None:
    scaler = make(initial_scale=1024.0, backoff_factor=0.25)
    scaler.update(overflow=True, step=0)
    assert scaler.scale == 256.0 and scaler.skipped_steps == 1
    scaler.update(overflow=False, step=1)
    scaler.update(overflow=True, step=2)
    assert scaler.scale == 64.0 and scaler.skipped_steps == 2
    assert scaler.clean_steps == 0  # an overflow restarts the growth interval


def test_growth_after_interval_of_clean_steps() -> None:
    scaler = make(initial_scale=8.0, growth_interval=3, growth_factor=4.0)
    for step in range(2):
        scaler.update(overflow=False, step=step)
    assert scaler.scale == 8.0 and scaler.clean_steps == 2
    scaler.update(overflow=False, step=2)
    assert scaler.scale == 32.0 and scaler.clean_steps == 0
    for step in range(3, 6):
        scaler.update(overflow=False, step=step)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 0


def test_overflow_resets_growth_interval() -> None:
    scaler = make(initial_scale=8.0, growth_interval=3)
    scaler.update(overflow=False, step=0)
    scaler.update(overflow=False, step=1)
    scaler.update(overflow=True, step=2)
    assert scaler.scale == 4.0
    scaler.update(overflow=False, step=3)
    scaler.update(overflow=False, step=4)
    assert scaler.scale == 4.0  # only two clean steps since the overflow
    scaler.update(overflow=False, step=5)
    assert scaler.scale == 8.0


def test_min_scale_floor() -> None:
    scaler = make(initial_scale=16.0, min_scale=3.0, backoff_factor=0.5)
    scaler.update(overflow=True, step=0)
    scaler.update(overflow=True, step=1)
    assert scaler.scale == 4.0
    scaler.update(overflow=True, step=2)
    assert scaler.scale == 3.0  # not 2.0
    scaler.update(overflow=True, step=3)
    assert scaler.scale == 3.0 and scaler.skipped_steps == 4


def test_repeated_overflows_at_floor_raise() -> None:
    scaler = make(initial_scale=1.0, min_scale=1.0)
    for step in range(MAX_OVERFLOWS_AT_MIN_SCALE - 1):
        scaler.update(overflow=True, step=step)
    assert scaler.scale == 1.0
    with pytest.raises(FloatingPointError, match="bf16"):
        scaler.update(overflow=True, step=MAX_OVERFLOWS_AT_MIN_SCALE)


def test_clean_step_at_floor_resets_the_overflow_count() -> None:
    scaler = make(initial_scale=1.0, min_scale=1.0)
    for step in range(MAX_OVERFLOWS_AT_MIN_SCALE - 1):
        scaler.update(overflow=True, step=step)
    scaler.update(overflow=False, step=100)
    for step in range(MAX_OVERFLOWS_AT_MIN_SCALE - 1):
        scaler.update(overflow=True, step=200 + step)  # does not raise: the count restarted
    assert scaler.skipped_steps == 2 * (MAX_OVERFLOWS_AT_MIN_SCALE - 1)


def test_state_dict_round_trip() -> None:
    a = make(initial_scale=64.0, growth_interval=4)
    for step, overflow in enumerate([True, False, False, True, False, False, False]):
        a.update(overflow=overflow, step=step)
    state = a.state_dict()
    assert state == {"scale": 16.0, "clean_steps": 3, "skipped_steps": 2, "overflows_at_min": 0}
    b = make(initial_scale=64.0, growth_interval=4)
    b.load_state_dict(state)
    assert b.state_dict() == state
    a.update(overflow=False, step=7)
    b.update(overflow=False, step=7)
    assert a.scale == b.scale == 32.0 and a.state_dict() == b.state_dict()


def test_state_dict_keeps_overflows_at_floor() -> None:
    a = make(initial_scale=1.0, min_scale=1.0)
    for step in range(MAX_OVERFLOWS_AT_MIN_SCALE - 1):
        a.update(overflow=True, step=step)
    b = make(initial_scale=1.0, min_scale=1.0)
    b.load_state_dict(a.state_dict())
    with pytest.raises(FloatingPointError):
        b.update(overflow=True, step=MAX_OVERFLOWS_AT_MIN_SCALE)


# -- the engine: an fp16 backward must carry the loss scale (engine.py [Note: an fp16 backward without
# the loss scale]) ---------------------------------------------------------------------------------------
def _fp16_model(dtype: str = "fp16", clip: float | None = 0.5):
    import torch

    import zeroinf
    from tests._parity import LR, build_model

    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, param_dtype=dtype, grad_clip_norm=clip))
    return model, zeroinf.AdamW(model, lr=LR)


def test_an_unscaled_fp16_backward_is_refused() -> None:
    """`loss.backward()` in fp16 trained on gradients 65536 times too small: a norm of 1e-5 instead of
    0.65, clipping at 0.5 that never triggered, and different losses from the first step on."""
    from tests._parity import global_batch

    model, opt = _fp16_model()
    x, y = global_batch(0)
    with pytest.raises(RuntimeError, match=r"call optimizer.backward\(loss\) instead of loss.backward\(\)"):
        model(x, y).backward()
    model, opt = _fp16_model()  # the same loop through opt.backward trains, and clips by the true norm
    for step in range(2):
        x, y = global_batch(step)
        opt.backward(model(x, y))
        opt.step()
        opt.zero_grad()
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.5


def test_loss_backward_stays_plain_pytorch_in_bf16_and_without_an_optimizer() -> None:
    import torch

    import zeroinf
    from tests._parity import build_model, global_batch

    model, opt = _fp16_model(dtype="bf16")
    x, y = global_batch(0)
    model(x, y).backward()  # no loss scale in bf16: loss.backward() is opt.backward(loss)
    opt.step()
    torch.manual_seed(0)
    frozen = zeroinf.shard(build_model(), zeroinf.Config(stage=3, param_dtype="fp16"))
    frozen(x, y).backward()  # no optimizer steps it (a teacher, a probe): nothing to scale


def test_torch_gradscaler_is_refused_by_name() -> None:
    """nanoGPT's loop (autocast, GradScaler.scale/unscale_/step) met "No inf checks were recorded for
    this optimizer" inside the scaler: the gradients it looks for never sit in p.grad."""
    import torch

    import zeroinf
    from tests._parity import LR, build_model, global_batch

    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=2))
    opt = zeroinf.AdamW(model, lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    x, y = global_batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler cannot drive zeroinf.AdamW.*param_dtype='fp16'"):
        scaler.step(opt)


@pytest.mark.parametrize("stage", [0, 3])
def test_user_autocast_over_fp32_parameters_equals_plain_pytorch(stage: int) -> None:
    """A loop that keeps its own `torch.autocast` around the forward (fp32 parameters, bf16 compute
    per op) trains bitwise as plain PyTorch does."""
    import torch

    import zeroinf
    from tests._parity import LR, build_model, global_batch

    def run(sharded: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = build_model()
        if sharded:
            model = zeroinf.shard(model, zeroinf.Config(stage=stage, persist_threshold_bytes=0))
            opt: torch.optim.Optimizer = zeroinf.AdamW(model, lr=LR)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        losses = []
        for step in range(3):
            x, y = global_batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.clone() for k, v in model.state_dict().items()}

    (plain_losses, plain), (losses, ours) = run(False), run(True)
    assert losses == plain_losses
    assert all(torch.equal(ours[k], v) for k, v in plain.items())


# -- a bf16 model under the default fp32 compute dtype (precision.py [Note: a bf16 model under the default
# fp32 compute dtype]) ----------------------------------------------------------------------------------
def test_a_bf16_model_under_fp32_compute_is_named_at_the_shard_call() -> None:
    """A model loaded in bf16 and sharded with the default param_dtype computes in fp32, at twice the
    memory it was loaded in: said once, at the caller's line, with the setting that keeps bf16."""
    import warnings

    import torch

    import zeroinf
    from tests._parity import build_model

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"100% of the model's parameters are bfloat16, .*param_dtype='bf16'") as got:
        model = zeroinf.shard(build_model().to(torch.bfloat16), zeroinf.Config(stage=3))
    assert [w.filename for w in got if "param_dtype" in str(w.message)] == [__file__]
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the config's word holds
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same model in bf16, and an fp32 model: nothing to say
        zeroinf.shard(build_model().to(torch.bfloat16), zeroinf.Config(stage=3, param_dtype="bf16"))
        zeroinf.shard(build_model(), zeroinf.Config(stage=3))
