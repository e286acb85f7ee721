"""The demo GPT: config validation, shapes, tied weights, init, dtypes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from zeroinf.models.gpt import GPT, PRESETS, Block, GPTConfig

TINY = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="d_model"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.5)
    assert GPTConfig(d_model=64, mlp_ratio=2).d_ff == 128
    assert GPTConfig(d_model=64, d_ff=100).d_ff == 100


def test_presets_and_overrides() -> None:
    assert {"tiny", "small", "125m", "350m"} <= set(PRESETS)
    cfg = GPTConfig.preset("small", n_layer=2, d_model=None)
    assert cfg.n_layer == 2 and cfg.d_model == PRESETS["small"].d_model
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("huge")
    nominal = {"125m": 125e6, "350m": 350e6, "1.3b": 1.3e9}
    for name, count in nominal.items():
        assert abs(PRESETS[name].param_count / count - 1) < 0.05, name


@pytest.mark.parametrize("tie", [True, False])
def test_param_count_matches_the_module(tie: bool) -> None:
    cfg = dataclasses.replace(TINY, tie_embeddings=tie)
    model = GPT(cfg)
    assert model.num_params() == cfg.param_count
    if tie:
        assert model.head is None
        untied = GPT(dataclasses.replace(TINY, tie_embeddings=False))
        assert untied.num_params() - model.num_params() == cfg.vocab_size * cfg.d_model


def test_blocks_are_a_module_list_of_blocks() -> None:
    model = GPT(TINY)
    assert isinstance(model.blocks, nn.ModuleList)
    assert [type(b) for b in model.blocks] == [Block, Block]


def test_forward_shapes_loss_and_backward() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    loss = model(idx, idx)
    assert loss.shape == () and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.3  # near-uniform predictions at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.tok_emb.weight.grad.abs().sum() > 0  # reached through both the input and the tied head


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    assert torch.allclose(model(idx)[:, :10], model(changed)[:, :10], atol=1e-6)


def test_too_long_sequence_raises() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        GPT(TINY)(torch.zeros(1, 17, dtype=torch.long))


def test_init_is_deterministic_for_a_seed_and_reset_reinitializes() -> None:
    torch.manual_seed(5)
    a = GPT(TINY)
    torch.manual_seed(5)
    b = GPT(TINY)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert a.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.2)
    with torch.no_grad():
        for p in a.parameters():
            p.zero_()
    torch.manual_seed(6)
    a.reset_parameters()
    torch.manual_seed(6)
    b.reset_parameters()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert a.blocks[0].attn.qkv.weight.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_parameters(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = GPT(TINY).to(dtype)
    idx = torch.randint(0, 256, (2, 16))
    assert model(idx).dtype == dtype
    loss = model(idx, idx)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad.dtype == dtype for p in model.parameters())


def test_flops_per_token_is_about_six_per_weight() -> None:
    model = GPT(TINY)
    assert model.flops_per_token() >= 6 * (model.num_params() - TINY.seq_len * TINY.d_model)
