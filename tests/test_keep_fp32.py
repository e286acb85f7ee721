"""Parameters and buffers a model keeps in fp32 under a bf16 compute dtype (Config.keep_fp32;
precision.py [Note: parameters the model keeps in fp32]), as transformers' MoE models declare their
routers (`_keep_in_fp32_modules_strict = ["gate.weight", "e_score_correction_bias"]`).

The reference is that semantics by hand at one and two ranks: fp32 masters; each step a compute copy
in bf16 except the kept gate weights and score biases, which stay fp32; gradients widened to fp32 and
averaged over the ranks; fused AdamW on the masters. zeroinf at stages 1-3 (stage 3 with its shards on
the host and on NVMe, the kept parameters in units of their own) matches it bit for bit, losses and
every state entry, dtypes included. With `keep_fp32=()` everything is bf16 again (`module.to(bf16)`)
and matches that reference instead. A stage-3 checkpoint loads into a model built afresh, and into
one that keeps nothing in fp32 (the same values, rounded); consolidated in bf16 it writes the kept
ones in fp32, as transformers' `save_pretrained` does. Under fp16, what a model keeps under fp16
only (T5's `_keep_in_fp32_modules`) is kept too, and trains with the loss scale.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._harness import run_ranks
from tests._parity import masters_by_hand, sharded_on_rows

STEPS, LR = 3, 1e-2
KEPT = ("gate.weight", "score_bias")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(8, 8), nn.Linear(8, 4, bias=False), nn.Linear(4, 8)
        # a bias the router adds to its scores (DeepSeek-V3's e_score_correction_bias), not exact in bf16
        self.register_buffer("score_bias", torch.linspace(0.1, 0.7, 4) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        # the router scores in fp32 whatever its weight's dtype, as DeepSeek-V3's does
        scores = (F.linear(h.float(), self.gate.weight.float()) + self.score_bias.float()).softmax(-1)
        return x + self.out(scores.to(x.dtype))


class Net(nn.Module):
    _keep_in_fp32_modules_strict = list(KEPT)  # read by Config.keep_fp32="auto", as transformers' attribute

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().pow(2).mean()


def _kept(name: str) -> bool:
    return any(k in name for k in KEPT)


Run = tuple[list[float], dict[str, torch.Tensor]]
CASES: dict[str, dict] = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3-host": {"stage": 3, "offload": {"params": "host", "optimizer": "host"}},
    "stage3-nvme": {"stage": 3, "offload": {"params": "nvme", "optimizer": "nvme"}},
    "stage3-none": {"stage": 3, "keep_fp32": ()},
    "stage2-none": {"stage": 2, "keep_fp32": ()},
}


def _zeroinf(case: dict, rank: int, world: int, folder: str) -> tuple[Run, dict[str, torch.dtype], list[str]]:
    import zeroinf

    torch.manual_seed(0)
    offload = zeroinf.OffloadConfig(**case.get("offload", {}), nvme_dir=folder)
    cfg = zeroinf.Config(
        stage=case["stage"], param_dtype="bf16", persist_threshold_bytes=0, offload=offload,
        keep_fp32=case.get("keep_fp32", "auto"),
    )
    model = zeroinf.shard(Net(), cfg)
    units = [u.name for u in zeroinf.engine_of(model).all_units]
    opt = zeroinf.AdamW(model, lr=LR, weight_decay=0.0)
    losses = sharded_on_rows(model, opt, rank, world, STEPS)
    state = model.state_dict()
    dtypes = {k: v.dtype for k, v in state.items()}
    out = {k: v.float().clone() for k, v in state.items()}
    if case["stage"] == 3 and "offload" not in case:  # a checkpoint of it loads into a model built afresh
        ckpt = os.path.join(folder, "ckpt")
        zeroinf.save(ckpt, model, opt, step=STEPS)
        torch.manual_seed(1)
        again = zeroinf.shard(Net(), cfg)
        opt2 = zeroinf.AdamW(again, lr=LR, weight_decay=0.0)
        zeroinf.load(ckpt, again, opt2)
        loaded = again.state_dict()
        for k, v in state.items():
            assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
        opt2.close()
        zeroinf.engine_of(again).close()
        if rank == 0:  # consolidated in bf16: what the run kept in fp32 is written in fp32, as transformers does
            from safetensors.torch import load_file

            zeroinf.consolidate(ckpt, os.path.join(folder, "hf"), dtype="bf16")
            written: dict[str, torch.Tensor] = {}
            for f in sorted(os.listdir(os.path.join(folder, "hf"))):
                if f.endswith(".safetensors"):
                    written.update(load_file(os.path.join(folder, "hf", f)))
            assert written.keys() == state.keys()
            for k, v in state.items():
                assert written[k].dtype == v.dtype and torch.equal(written[k], v), k
        # and into a model that keeps nothing in fp32 (units laid out otherwise): the same values, rounded
        rounded = zeroinf.shard(Net(), dataclasses.replace(cfg, keep_fp32=()))
        opt3 = zeroinf.AdamW(rounded, lr=LR, weight_decay=0.0)
        zeroinf.load(ckpt, rounded, opt3)
        for k, v in rounded.state_dict().items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, state[k].to(torch.bfloat16)), k
        opt3.close()
        zeroinf.engine_of(rounded).close()
    opt.close()
    zeroinf.engine_of(model).close()
    return (losses, out), dtypes, units


def _by_hand(rank: int, world: int, keep: bool, device: torch.device | None = None) -> Run:
    torch.manual_seed(0)
    master = Net().to(device)

    def compute_copy() -> nn.Module:
        compute = copy.deepcopy(master).to(torch.bfloat16)
        if keep:  # the kept parameters and buffers compute from their fp32 values
            for (name, c), m in zip(compute.named_parameters(), master.parameters(), strict=True):
                if _kept(name):
                    c.data = m.detach().clone()
            for (name, c), m in zip(compute.named_buffers(), master.buffers(), strict=True):
                if _kept(name):
                    c.data = m.clone()
        return compute

    losses = masters_by_hand(master, compute_copy, rank, world, STEPS, LR, device)
    return losses, {k: v.float().clone() for k, v in compute_copy().state_dict().items()}


def _every_case(rank: int, world: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="zeroinf-keep-fp32-") as tmp:
        if world > 1:  # one folder for every rank (swap files are named by rank)
            names = [tmp if rank == 0 else ""]
            torch.distributed.broadcast_object_list(names, src=0)
            folder = names[0] if rank else tmp
        else:
            folder = tmp
        out = {name: _zeroinf(case, rank, world, os.path.join(folder, name)) for name, case in CASES.items()}
        if world > 1:
            torch.distributed.barrier()
    out["by-hand-kept"] = _by_hand(rank, world, keep=True)
    out["by-hand-none"] = _by_hand(rank, world, keep=False)
    return out


def _assert_bitwise(runs: dict) -> None:
    for name, case in CASES.items():
        (losses, state), dtypes, units = runs[name]
        kept = case.get("keep_fp32", "auto") == "auto"
        ref_losses, ref_state = runs["by-hand-kept" if kept else "by-hand-none"]
        assert ref_losses[-1] < ref_losses[0], "the reference must learn"
        assert losses == ref_losses, (name, losses, ref_losses)
        assert state.keys() == ref_state.keys()
        for key, tensor in ref_state.items():
            assert torch.equal(state[key], tensor), (name, key)
            want = torch.float32 if kept and _kept(key) else torch.bfloat16
            assert dtypes[key] == want, (name, key, dtypes[key])
        twins = sorted(u for u in units if u.endswith("#fp32"))
        assert twins == (["blocks.0#fp32", "blocks.1#fp32"] if kept else []), (name, units)
    # keeping them in fp32 changes the run: the test would not tell the two semantics apart otherwise
    assert runs["by-hand-kept"][0] != runs["by-hand-none"][0]


def test_kept_fp32_parameters_match_that_semantics_by_hand() -> None:
    _assert_bitwise(_every_case(0, 1))


def test_kept_fp32_parameters_match_at_two_ranks() -> None:
    for runs in run_ranks(_every_case, 2, timeout_s=300):
        _assert_bitwise(runs)


def test_which_names_are_kept() -> None:
    import zeroinf
    from zeroinf.precision import declared_fp32, fp32_names

    class T5Like(nn.Module):
        _keep_in_fp32_modules = ["wo"]  # transformers keeps these under fp16 only

    assert declared_fp32(T5Like(), "bf16") == ()
    assert declared_fp32(T5Like(), "fp16") == ("wo",)
    wrapper = nn.Sequential(Net())  # a wrapper (peft) around the declaring model: read from every module
    assert declared_fp32(wrapper, "bf16") == ("gate.weight", "score_bias")
    keep = fp32_names(wrapper, zeroinf.Config(param_dtype="bf16"))
    assert keep is not None and keep("0.blocks.1.gate.weight") and not keep("0.blocks.1.inp.weight")
    assert fp32_names(wrapper, zeroinf.Config(param_dtype="fp32")) is None  # nothing to keep
    assert fp32_names(wrapper, zeroinf.Config(param_dtype="bf16", keep_fp32=())) is None
    custom = fp32_names(nn.Linear(2, 2), zeroinf.Config(param_dtype="bf16", keep_fp32=["layers.*.norm"]))
    assert custom is not None and custom("model.layers.3.norm.weight") and not custom("model.norm.weight")


@pytest.mark.parametrize("bad", ["gate.weight", [""], [3], {"gate": 1}])
def test_keep_fp32_refuses_what_is_not_a_list_of_patterns(bad: object) -> None:
    import zeroinf

    with pytest.raises(zeroinf.ConfigError, match="keep_fp32"):
        zeroinf.Config(keep_fp32=bad)  # type: ignore[arg-type]


class FP16Net(Net):
    _keep_in_fp32_modules_strict: list[str] = []
    _keep_in_fp32_modules = list(KEPT)  # transformers keeps these under fp16 only (T5's `wo`)


def test_what_a_model_keeps_under_fp16_only_is_kept_under_fp16() -> None:
    import zeroinf

    for dtype in ("bf16", "fp16"):
        torch.manual_seed(0)
        model = zeroinf.shard(FP16Net(), zeroinf.Config(stage=3, param_dtype=dtype, persist_threshold_bytes=0))
        units = [u.name for u in zeroinf.engine_of(model).all_units]
        opt = zeroinf.AdamW(model, lr=LR, weight_decay=0.0)
        losses = sharded_on_rows(model, opt, 0, 1, STEPS)  # fp16: opt.backward scales, the step unscales
        dtypes = {k: v.dtype for k, v in model.state_dict().items()}
        opt.close()
        zeroinf.engine_of(model).close()
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (dtype, losses)
        narrow = torch.float16 if dtype == "fp16" else torch.bfloat16
        for key, got in dtypes.items():
            assert got == (torch.float32 if dtype == "fp16" and _kept(key) else narrow), (dtype, key, got)
        assert sum(u.endswith("#fp32") for u in units) == (2 if dtype == "fp16" else 0), units
