"""activations.py beyond the parity matrix (which checkpoints and offloads the test model at every
stage): a Hugging Face model under `activation_checkpointing` trains without a KV cache, as with
its own gradient checkpointing, and keeps its cache where it is used (evaluation, `generate`)."""

from __future__ import annotations

import torch

import zeroinf
from tests._hf import build, global_batch, greedy, prompts


def _train(checkpointing: bool, steps: int = 3) -> tuple[torch.nn.Module, list[float], list[object]]:
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, activation_checkpointing=checkpointing)
    model = zeroinf.shard(build("llama"), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    losses, caches = [], []
    for step in range(steps):
        ids = global_batch(step)
        out = model(input_ids=ids, labels=ids)
        opt.backward(out.loss)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        caches.append(out.past_key_values)
    return model, losses, caches


def test_checkpointed_training_builds_no_kv_cache_and_trains_the_same() -> None:
    plain, plain_losses, plain_caches = _train(False)
    model, losses, caches = _train(True)
    seq = global_batch(0).shape[1]
    # Without checkpointing Hugging Face builds a cache every training step (config.use_cache); with
    # it, the recompute would append the layer's keys again: twice the sequence, held for nothing.
    assert all(c is not None and c.get_seq_length() == seq for c in plain_caches)
    assert caches == [None] * len(caches)
    assert losses == plain_losses
    weights, plain_weights = model.state_dict(), plain.state_dict()
    assert all(torch.equal(weights[k], w) for k, w in plain_weights.items())
    with torch.no_grad():  # evaluation keeps its cache, and generation its speed
        ids = global_batch(0)
        assert model(input_ids=ids).past_key_values.get_seq_length() == seq
        model.eval()
        assert torch.equal(greedy(model, prompts(0)), greedy(plain.eval(), prompts(0)))
    model.train()
    ids = global_batch(3)  # a caller's explicit use_cache=True is overridden too, as Hugging Face does
    assert model(input_ids=ids, labels=ids, use_cache=True).past_key_values is None


def test_only_models_with_a_cache_flag_and_a_use_cache_argument_are_rewritten() -> None:
    from zeroinf.activations import no_cache_in_training

    class NoKwargs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"use_cache": True})()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    from tests._parity import build_model

    assert no_cache_in_training(build_model()) == []  # no config
    assert no_cache_in_training(NoKwargs()) == []  # a config, but nowhere to pass use_cache
    assert len(no_cache_in_training(build("gpt2"))) == 1
