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


def test_a_recompute_that_fails_where_the_forward_ran_names_the_unit_and_the_fix() -> None:
    """A unit that keeps state between calls (here a call counter; Hugging Face's XLM extends its own KV
    cache) meets other inputs in its recompute: the error says a recompute failed, in which unit, why,
    and what to do (activations.py [Note: a recompute that fails where the forward ran])."""
    import pytest

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            shift = torch.zeros(8)[: 8 // self.calls]  # 8 wide in the forward, 4 in the recompute
            return self.out(torch.relu(self.lin(x)) + shift)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Counting(), Counting()])
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = zeroinf.shard(Net(), zeroinf.Config(stage=3, persist_threshold_bytes=0, activation_checkpointing=True))
    opt = zeroinf.AdamW(model, lr=1e-3)
    loss = model(torch.randn(2, 8)).square().mean()  # the forward runs: each unit called once
    with pytest.raises(RuntimeError, match=r"recomputing unit Counting in backward failed where its forward ran "
                       r"\(RuntimeError: .*keeps state between calls.*activation_checkpointing=False") as got:
        opt.backward(loss)
    assert isinstance(got.value.__cause__, RuntimeError)  # the model's own error, chained
