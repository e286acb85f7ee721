"""Precision: dynamic loss scaling (back off and skip on overflow, grow after clean intervals, stop at
the floor), and which buffers take the compute dtype."""

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


# -- which buffers take the compute dtype (precision.py [Note: which buffers take the compute dtype]) ----------
def test_buffers_take_the_compute_dtype_except_rotary_frequency_tables() -> None:
    import torch
    from torch import nn

    import zeroinf

    class Tables(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("scale", torch.full((8,), 0.5))  # persistent
            self.register_buffer("mask", torch.tril(torch.ones(8, 8)), persistent=False)  # a derived table
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)
            self.register_buffer("positions", torch.arange(8), persistent=False)  # not floating

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * self.scale) @ self.mask

    torch.manual_seed(0)
    model = zeroinf.shard(Tables(), zeroinf.Config(stage=3, param_dtype="bf16"))
    dtypes = {name: b.dtype for name, b in model.named_buffers()}
    assert dtypes == {"scale": torch.bfloat16, "mask": torch.bfloat16, "inv_freq": torch.float32,
                      "positions": torch.int64}
    assert model(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["openai-gpt", "xglm", "codegen", "llama"])
def test_hf_models_compute_in_bf16_as_cast_by_hand(arch: str) -> None:
    """Built in fp32, sharded with bf16 compute: the first loss is bitwise that of the model cast with
    `.to(torch.bfloat16)` (rotary `inv_freq` kept fp32, as Hugging Face keeps it). openai-gpt's causal
    mask and xglm's sinusoidal positions, non-persistent fp32 tables kept as built, used to upcast
    the activations and stop the forward (a matmul, a layer norm refusing mixed dtypes); codegen's
    sinusoidal table computed its loss in another precision."""
    import copy

    import torch

    pytest.importorskip("transformers")
    import transformers as tf

    import zeroinf
    from zeroinf.precision import keeps_its_precision

    tf.utils.logging.set_verbosity_error()
    small = dict(vocab_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    configs = {
        "openai-gpt": lambda: tf.OpenAIGPTLMHeadModel(tf.OpenAIGPTConfig(
            n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **small)),
        "xglm": lambda: tf.XGLMForCausalLM(tf.XGLMConfig(
            d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, max_position_embeddings=32, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=0, **{**small, "pad_token_id": 1})),
        "codegen": lambda: tf.CodeGenForCausalLM(tf.CodeGenConfig(
            n_embd=32, n_layer=2, n_head=4, n_positions=32, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **small)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32, **small)),
    }
    torch.manual_seed(0)
    model = configs[arch]()
    by_hand = copy.deepcopy(model)
    kept = {(n, b): t for n, m in by_hand.named_modules() for b, t in m._buffers.items()
            if t is not None and keeps_its_precision(m, b)}
    by_hand = by_hand.to(torch.bfloat16)
    for (n, b), t in kept.items():
        by_hand.get_submodule(n)._buffers[b] = t
    assert (arch == "llama") == bool(kept)
    ids = torch.randint(2, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = by_hand(input_ids=ids, labels=ids).loss
    sharded = zeroinf.shard(model, zeroinf.Config(stage=3, param_dtype="bf16", persist_threshold_bytes=0))
    opt = zeroinf.AdamW(sharded, lr=1e-3)
    loss = sharded(input_ids=ids, labels=ids).loss
    assert loss.dtype == expected.dtype and torch.equal(loss, expected)
    opt.backward(loss)
    opt.step()
    assert torch.isfinite(sharded(input_ids=ids, labels=ids).loss)
