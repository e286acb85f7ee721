"""Training loops in random orders against plain PyTorch (world 1, in this process).

A loop is more than forward, backward, step: users evaluate between steps (`eval()` + `no_grad`),
read the `state_dict`, change the learning rate by hand, call `zero_grad()` once too often, read a
parameter's optimizer state or reset it (`zeroinf.optimizer_state` / `set_optimizer_state` against
`opt.state[p]`), read parameters inside `zeroinf.gathered`,
accumulate micro-steps, call `torch.nn.utils.clip_grad_norm_` before the step (half the clipping
seeds; it must return torch's norm). Each seed draws a stage (0-3), the tiers of parameters and
optimizer states, accumulation (1 or 2) and clipping, and a legal sequence of those operations; every loss, every
evaluation, every `state_dict` read and the final weights must equal `torch.optim.AdamW(fused=True)`
on the same model, whether zeroinf.AdamW or torch's AdamW through zeroinf.ShardedOptimizer (every
third seed) steps the sharded one: bitwise without clipping, within 1e-5 (relative and absolute) with
it: torch's `clip_grad_norm_` sums the squares in another order, and Adam turns the last-bit
difference of the coefficient into differences of about 1e-8 after a few steps, but up to 1.4e-6
(half a thousandth of a step at lr 3e-3) where a gradient of about Adam's eps meets a first moment
that nearly cancels it (seeds 88, 447, 480 and 568 of 600 drawn, with an absolute 1e-6).

"Legal" leaves out what zeroinf refuses with an error by design (a `step()` without the
configured number of backward passes, a backward too many) and reads between a backward and its
`step()`, which see weights already stepped inside backward (README, "Gradients never sit in
`p.grad`").
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model, global_batch

OPS = ["fb", "fb", "fb", "step", "step", "zero", "eval", "no_grad", "state_dict", "lr", "opt_state", "reset",
       "gathered"]
# only where no backward waits for its step
READS = ("eval", "no_grad", "state_dict", "zero", "lr", "opt_state", "reset", "gathered")
WATCHED = ("tok.weight", "blocks.1.qkv.weight")  # parameters whose optimizer state is read, reset, gathered


def _draw(seed: int, swap_dir: str) -> tuple[zeroinf.Config, list[str], dict[str, Any]]:
    rng = random.Random(seed)
    stage = rng.choice([0, 1, 2, 3])
    params = rng.choice(["device", "host", "nvme"]) if stage == 3 else "device"
    optimizer = rng.choice(["device", "host", "nvme"]) if stage >= 1 else "device"
    accum, clip = rng.choice([1, 1, 2]), rng.choice([None, None, 0.5])
    offload = zeroinf.OffloadConfig(
        params=params, optimizer=optimizer, nvme_dir=swap_dir if "nvme" in (params, optimizer) else None,
        step_in_backward=rng.choice(["auto", True, False]),
    )
    cfg = zeroinf.Config(
        stage=stage, offload=offload, persist_threshold_bytes=0, grad_accum_steps=accum, grad_clip_norm=clip
    )
    seq: list[str] = []
    pending = 0  # backward passes since the last step
    length = rng.randint(4, 12)
    while len(seq) < length:
        op = rng.choice(OPS)
        if (op == "step" and pending != accum) or (op == "fb" and pending == accum) or (op in READS and pending):
            continue
        pending = pending + 1 if op == "fb" else 0 if op == "step" else pending
        seq.append(op)
    return cfg, seq, {"accum": accum, "clip": clip}


@pytest.mark.parametrize("seed", range(48))
def test_a_random_loop_equals_plain_pytorch(seed: int, tmp_path: Any) -> None:
    cfg, seq, drawn = _draw(seed, str(tmp_path))
    clip = drawn["clip"]
    # with clipping, every other seed calls torch's clip_grad_norm_ on the sharded model too (optim/torch_clip.py)
    call_clip = clip is not None and random.Random(f"clip {seed}").random() < 0.5

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if clip is None else torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    torch.manual_seed(0)
    ref = build_model()
    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True)
    # every third seed runs torch's own AdamW over the shards (zeroinf.ShardedOptimizer): the same reference
    generic = seed % 3 == 2
    opt: Any = (
        zeroinf.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=LR, weight_decay=0.1, fused=True)
        if generic else zeroinf.AdamW(model, lr=LR, weight_decay=0.1)
    )
    where = (
        f"seed {seed}, stage {cfg.stage}, {cfg.offload.params}/{cfg.offload.optimizer}, {drawn}, {call_clip}, "
        f"{'ShardedOptimizer' if generic else 'AdamW'}, {seq}"
    )
    pending = 0
    try:
        for i, op in enumerate(seq):
            x, y = global_batch(i)
            if op == "fb":
                expected = ref(x, y)
                expected.backward()
                got = model(x, y)
                opt.backward(got)
                assert same(got.detach(), expected.detach()), (where, i, got.item(), expected.item())
                pending += 1
            elif op == "step":
                if clip is not None:
                    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                    if call_clip:  # as the plain loop does: the norm the step clips with
                        got = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                        assert same(got, expected), (where, i, got.item(), expected.item())
                ref_opt.step()
                opt.step()
                ref_opt.zero_grad()
                opt.zero_grad()
                pending = 0
            elif op == "zero":
                ref_opt.zero_grad()
                opt.zero_grad()
            elif op in ("eval", "no_grad"):
                if op == "eval":
                    ref.eval()
                    model.eval()
                with torch.no_grad():
                    expected, got = ref(x, y), model(x, y)
                ref.train()
                model.train()
                assert same(got, expected), (where, i, got.item(), expected.item())
            elif op == "state_dict":
                theirs, ours = ref.state_dict(), model.state_dict()
                assert all(same(ours[k], theirs[k]) for k in theirs), (where, i)
            elif op == "lr":
                for group in [*ref_opt.param_groups, *opt.param_groups]:
                    group["lr"] *= 0.5
            elif op in ("opt_state", "reset"):
                named, ref_named = dict(model.named_parameters()), dict(ref.named_parameters())
                read = zeroinf.optimizer_state(opt, [named[n] for n in WATCHED])
                for n in WATCHED:
                    theirs = ref_opt.state[ref_named[n]]
                    ours = read[named[n]]
                    assert float(ours["step"]) == float(theirs.get("step", 0)), (where, i, n)
                    for kind in ("exp_avg", "exp_avg_sq"):
                        expected = theirs[kind] if kind in theirs else torch.zeros_like(ref_named[n])
                        assert same(ours[kind], expected), (where, i, n, kind)
                    assert same(ours["master"], ref_named[n].detach()), (where, i, n)
                if op == "reset" and ref_opt.state[ref_named[WATCHED[0]]]:
                    shape = ref_named[WATCHED[0]].shape
                    zero = {"exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape), "step": 0}
                    zeroinf.set_optimizer_state(opt, {named[WATCHED[0]]: zero})
                    for value in ref_opt.state[ref_named[WATCHED[0]]].values():
                        value.zero_()
            elif op == "gathered":
                named, ref_named = dict(model.named_parameters()), dict(ref.named_parameters())
                with zeroinf.gathered([named[n] for n in WATCHED]):
                    assert all(same(named[n].detach(), ref_named[n].detach()) for n in WATCHED), (where, i)
        if not pending:
            theirs, ours = ref.state_dict(), model.state_dict()
            differ = [k for k in theirs if not same(ours[k], theirs[k])]
            assert not differ, (where, differ[:3])
    finally:
        zeroinf.engine_of(model).close()
