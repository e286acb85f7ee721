"""Split layers (`Config.split_root`) and their weights read outside their own forward.

One spawned group at world 2, stage 3, parameters and optimizer states on NVMe, fp32, three cases
trained side by side with a plain PyTorch copy on the whole batch (torch.optim.AdamW):
- `Queries`: DETR's pattern, an `nn.Embedding` whose weight the model reads and never calls;
- the demo GPT with a tied head (`F.linear(x, self.tok_emb.weight)`);
- an untied Hugging Face Llama: embedding and head split, read only by their own forwards.
Each matches plain PyTorch (losses, and every weight after 3 steps); a layer read outside its
forward is gathered once a step (kept to the pass's end, not gathered again); a split layer is
sharded between steps, where the root used to keep it whole; outside a pass a read gathers nothing.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch
from torch import nn

import zeroinf
from tests._harness import run_ranks

D, VOCAB, QUERIES, STEPS, BATCH = 32, 64, 8, 3, 4


class Queries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Embedding(QUERIES, D)  # read as `.weight`, never called
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(2))
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.query.weight.unsqueeze(0)  # (batch, queries, D)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).square().mean()


def _build(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "queries":
        return Queries()
    if case == "gpt-tied":
        from zeroinf.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, d_model=D, n_head=2, seq_len=8))
    from tests import _hf

    return _hf.build("llama")


def _batch(case: str, step: int) -> Any:
    g = torch.Generator().manual_seed(100 + step)
    if case == "queries":
        return torch.randn(BATCH, QUERIES, D, generator=g)
    vocab = VOCAB if case == "gpt-tied" else 128
    return torch.randint(0, vocab, (BATCH, 9), generator=g)


def _loss(model: nn.Module, case: str, batch: Any) -> torch.Tensor:
    if case == "queries":
        return model(batch)
    if case == "gpt-tied":
        return model(batch[:, :-1], batch[:, 1:])
    return model(input_ids=batch, labels=batch).loss


def _count_gathers(engine: Any, unit_name: str | None) -> list[int]:
    """A counter of the all-gathers unit `unit_name` starts (its `start_unshard` from a shard)."""
    from zeroinf.partition.unit import ParamState

    calls = [0]
    if unit_name is None:
        return calls
    unit = next(u for u in engine.all_units if u.name == unit_name)
    start = unit.start_unshard

    def counted() -> None:
        calls[0] += unit.state in (ParamState.SHARDED, ParamState.FETCHING)
        start()

    unit.start_unshard = counted
    return calls


def _train(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, read_outside in (("queries", "query"), ("gpt-tied", "tok_emb"), ("llama", None)):
        folder = os.path.join(root, case, f"rank{rank}")
        os.makedirs(folder, exist_ok=True)
        model = _build(case)
        plain = copy.deepcopy(model)
        offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=folder)
        cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, split_root_min_bytes=0, offload=offload)
        model = zeroinf.shard(model, cfg)
        engine = zeroinf.engine_of(model)
        opt = zeroinf.AdamW(model, lr=1e-2, weight_decay=0.0)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
        losses, plain_losses, gathers, at_rest = [], [], [], []
        counter = _count_gathers(engine, read_outside)
        per = BATCH // world
        for step in range(STEPS):
            batch = _batch(case, step)
            before = counter[0]
            loss = _loss(model, case, batch[rank * per : (rank + 1) * per])
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            if read_outside:
                gathers.append(counter[0] - before)
            at_rest.append(sorted(u.name for u in engine.all_units if not u.resident and u.state.value != "sharded"))
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            losses.append(total.item() / world)
            plain_loss = _loss(plain, case, batch)
            plain_loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            plain_losses.append(plain_loss.item())
        collectives = engine.counter.total.get("all_gather", 0)
        placeholder_shape = None
        if read_outside:  # outside a pass: the placeholder, and no collective
            placeholder_shape = tuple(getattr(model, read_outside).weight.shape)
        read_gathers = engine.counter.total.get("all_gather", 0) - collectives
        state = {k: v.clone() for k, v in model.state_dict().items()}
        out[case] = {
            "units": [(u.name, u.resident) for u in engine.all_units],
            "losses": losses, "plain_losses": plain_losses, "gathers": gathers, "at_rest": at_rest,
            "placeholder_shape": placeholder_shape, "read_gathers": read_gathers,
            # attention's qkv bias: the key part gets only rounding noise for gradients (softmax ignores a
            # shift), which Adam scales to up to lr a step whatever the layout: bounded apart
            "max_weight_diff": max(
                (state[k] - v).abs().max().item() for k, v in plain.state_dict().items() if not k.endswith("qkv.bias")
            ),
            "qkv_bias_diff": max(
                [(state[k] - v).abs().max().item() for k, v in plain.state_dict().items() if k.endswith("qkv.bias")],
                default=0.0,
            ),
        }
        engine.close()
        opt.states.close()
    return out


def test_split_layers_train_like_plain_pytorch_and_external_reads_are_kept_for_the_pass() -> None:
    with tempfile.TemporaryDirectory(prefix="zeroinf-ext-") as root:
        results = run_ranks(_train, 2, root, timeout_s=240)
    for rank, per_rank in enumerate(results):
        for case, r in per_rank.items():
            where = f"{case} rank {rank}"
            for a, b in zip(r["losses"], r["plain_losses"], strict=True):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (where, r["losses"], r["plain_losses"])
            assert r["max_weight_diff"] <= 1e-5, (where, r["max_weight_diff"])
            assert r["qkv_bias_diff"] <= 2 * 1e-2 * STEPS, (where, r["qkv_bias_diff"])
            assert r["at_rest"] == [[]] * STEPS, where  # every split layer sharded between steps
        units = dict(per_rank["queries"]["units"])
        assert units["query"] is False, units  # a unit of its own, sharded
        # read outside its forward (never called): gathered once a step, at the read, and kept to
        # the end of the backward, which reads it again
        assert per_rank["queries"]["gathers"] == [1] * STEPS, per_rank["queries"]["gathers"]
        # the tied GPT's embedding: its own forward gathers it in the first step, the head's read again
        # (then it is known, and kept from the embedding's forward to the pass's end)
        assert per_rank["gpt-tied"]["gathers"] == [2, 1, 1], per_rank["gpt-tied"]["gathers"]
        assert per_rank["queries"]["placeholder_shape"] == (0, 0)
        assert per_rank["queries"]["read_gathers"] == per_rank["gpt-tied"]["read_gathers"] == 0
        llama = [name for name, resident in per_rank["llama"]["units"] if not resident]
        assert "model.embed_tokens" in llama and "lm_head" in llama, llama
