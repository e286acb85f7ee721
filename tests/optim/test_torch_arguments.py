"""`zeroinf.AdamW` takes what `torch.optim.AdamW` takes (optim/adamw.py [Note: torch.optim.AdamW's arguments]).

A loop moving to zeroinf swaps the class and keeps the arguments: `model.parameters()`, nanoGPT's
decay/no-decay groups built from `named_parameters()` (placeholders keep their number of
dimensions), `fused=True`, a tensor learning rate, `step(closure)`. Oracle: `torch.optim.AdamW(fused=True)` with
the same arguments on the plain model, world 1, stages 0-3: bitwise equal weights after 4 steps.
Frozen parameters in the iterable are dropped, as torch.optim never steps them (a LoRA-style model
at stage 1 keeps its frozen weights outside units). What it cannot do is refused by name: amsgrad,
maximize, capturable, differentiable; parameters of no sharded model, of two, or beside other
tensors (also in `param_groups=` beside the model); a trainable parameter left out; a group added
after construction (`add_param_group`). `zeroinf.Adam` is `torch.optim.Adam` (L2 weight decay),
also with bf16 moments.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroinf
from tests._parity import build_model, global_batch


def _nanogpt_groups(model: nn.Module) -> list[dict[str, Any]]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


ARGUMENTS = {
    "parameters": lambda m: ((m.parameters(),), {"lr": 1e-3, "fused": True}),
    "nanogpt-groups": lambda m: ((_nanogpt_groups(m),), {"lr": 1e-3, "betas": (0.9, 0.95), "fused": True}),
    "tensor-lr": lambda m: ((m.parameters(),), {"lr": torch.tensor(1e-3), "foreach": None}),
}


def _train_side_by_side(
    plain: nn.Module, plain_opt: torch.optim.Optimizer, model: nn.Module, opt: zeroinf.AdamW, clip: float | None = None
) -> None:
    """Four steps of the plain model with its torch optimizer and of the sharded one with zeroinf's."""
    for step in range(4):
        x, y = global_batch(step)
        plain(x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        plain_opt.step()
        plain_opt.zero_grad()
        opt.backward(model(x, y))
        opt.step()
        opt.zero_grad()


def _freeze_embeddings(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        if "emb" in name:
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "embeddings-frozen"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", sorted(ARGUMENTS))
def test_torch_optim_arguments_train_as_torch_optim(how: str, stage: int, frozen: bool) -> None:
    def built() -> nn.Module:
        torch.manual_seed(0)
        model = build_model()
        return _freeze_embeddings(model) if frozen else model

    plain = built()
    model = zeroinf.shard(built(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    args, kwargs = ARGUMENTS[how](plain)
    plain_opt = torch.optim.AdamW(*args, **{**kwargs, "fused": True, "foreach": None})
    args, kwargs = ARGUMENTS[how](model)
    opt = zeroinf.AdamW(*args, **kwargs)
    try:
        _train_side_by_side(plain, plain_opt, model, opt)
        theirs, ours = plain.state_dict(), model.state_dict()
        differ = [k for k, v in theirs.items() if not torch.equal(ours[k], v)]
        assert not differ, differ
        assert len(opt.param_groups) == len(plain_opt.param_groups)
    finally:
        zeroinf.engine_of(model).close()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_closure_step_trains_as_torch_optim(stage: int) -> None:
    """`opt.step(closure)` (it was refused): the closure runs with gradients enabled, its loss is
    returned, the step hooks run around it; bitwise torch.optim.AdamW's weights after 4 steps."""
    torch.manual_seed(0)
    plain = build_model()
    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    opt = zeroinf.AdamW(model.parameters(), lr=1e-3)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    try:
        for step in range(4):
            x, y = global_batch(step)

            def closure(
                net: nn.Module = model, optimizer: torch.optim.Optimizer = opt, x: torch.Tensor = x, y: torch.Tensor = y
            ) -> torch.Tensor:
                optimizer.zero_grad()
                loss = net(x, y)
                loss.backward()
                return loss

            theirs = plain_opt.step(lambda: closure(plain, plain_opt))
            with torch.no_grad():  # as torch.optim's own step: the closure enables gradients itself
                ours = opt.step(closure)
            assert torch.equal(ours, theirs)
        differ = [k for k, v in plain.state_dict().items() if not torch.equal(model.state_dict()[k], v)]
        assert not differ, differ
        assert calls == ["pre", "post"] * 4
    finally:
        zeroinf.engine_of(model).close()


def test_a_group_of_frozen_parameters_stays_a_group() -> None:
    """Its parameters are dropped, the group is kept: schedulers and loops index groups."""
    torch.manual_seed(0)
    model = zeroinf.shard(_freeze_embeddings(build_model()), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    embeddings = [p for n, p in model.named_parameters() if "emb" in n]
    rest = [p for n, p in model.named_parameters() if "emb" not in n]
    opt = zeroinf.AdamW([{"params": rest}, {"params": embeddings, "lr": 0.5}], lr=1e-3)
    try:
        assert [len(g["params"]) for g in opt.param_groups] == [len(rest), 0]
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5])
        x, y = global_batch(0)
        opt.backward(model(x, y))
        opt.step()
        scheduler.step()
        assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.25]
    finally:
        zeroinf.engine_of(model).close()


def _sharded(stage: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return zeroinf.shard(build_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0))


@pytest.mark.parametrize("flag", ["amsgrad", "maximize", "capturable", "differentiable"])
def test_variants_it_does_not_compute_are_refused(flag: str) -> None:
    model = _sharded()
    try:
        with pytest.raises(ValueError, match=f"does not implement {flag}=True"):
            zeroinf.AdamW(model.parameters(), lr=1e-3, **{flag: True})
    finally:
        zeroinf.engine_of(model).close()


def test_parameters_it_cannot_own_are_refused() -> None:
    a, b = _sharded(), _sharded(stage=2)
    try:
        with pytest.raises(TypeError, match="belong to no sharded model. Shard it first"):
            zeroinf.AdamW(build_model().parameters())
        with pytest.raises(ValueError, match="several sharded models"):
            zeroinf.AdamW([*a.parameters(), *b.parameters()])
        with pytest.raises(ValueError, match="a sharded model and 1 other tensors"):
            zeroinf.AdamW([*a.parameters(), nn.Parameter(torch.zeros(3))])
        with pytest.raises(ValueError, match="trainable parameters are in no param group"):
            zeroinf.AdamW(list(a.parameters())[:2])
        with pytest.raises(TypeError, match="not a mix of both"):
            zeroinf.AdamW([{"params": list(a.parameters())[:2]}, *list(a.parameters())[2:]])
        with pytest.raises(TypeError, match="pass them once"):
            zeroinf.AdamW(a.parameters(), param_groups=[{"params": list(a.parameters())}])
        # the same checks for groups given beside the model (a foreign tensor was kept and never stepped)
        with pytest.raises(ValueError, match="a sharded model and 1 other tensors"):
            zeroinf.AdamW(a, param_groups=[{"params": list(a.parameters())}, {"params": [nn.Parameter(torch.ones(2))]}])
        with pytest.raises(ValueError, match="another sharded model than the one given"):
            zeroinf.AdamW(a, param_groups=[{"params": list(b.parameters())}])
    finally:
        zeroinf.engine_of(a).close()
        zeroinf.engine_of(b).close()


def test_a_group_added_after_construction_is_refused() -> None:
    """torch.optim's add_param_group returned, and the added parameter was never stepped (its gradient
    stayed in .grad); the groups passed to the constructor work as before."""
    model = _sharded()
    try:
        trainable = list(model.parameters())
        opt = zeroinf.AdamW(model, param_groups=[{"params": trainable[:2], "lr": 0.5}, {"params": trainable[2:]}])
        assert [g["lr"] for g in opt.param_groups] == [0.5, 1e-3]
        extra = nn.Parameter(torch.ones(3))
        with pytest.raises(ValueError, match="add_param_group after the optimizer was built"):
            opt.add_param_group({"params": [extra]})
        assert len(opt.param_groups) == 2
    finally:
        zeroinf.engine_of(model).close()


@pytest.mark.parametrize(
    ("stage", "params", "optimizer", "clip"),
    [(1, "device", "device", None), (2, "device", "host", 0.5), (3, "nvme", "nvme", None), (3, "host", "host", 0.5)],
)
def test_adam_is_torch_adam(stage: int, params: str, optimizer: str, clip: float | None, tmp_path) -> None:
    """zeroinf.Adam: torch.optim.Adam's update (weight decay as an L2 term on the gradient), bitwise
    without clipping and within 1e-6 with it (torch's norm sums in another order), and unlike AdamW's."""
    offload = zeroinf.OffloadConfig(
        params=params, optimizer=optimizer, nvme_dir=str(tmp_path) if "nvme" in (params, optimizer) else None
    )
    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, grad_clip_norm=clip, offload=offload)
    torch.manual_seed(0)
    plain = build_model()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.Adam(model.parameters(), lr=1e-3, weight_decay=0.1)
    try:
        _train_side_by_side(plain, plain_opt, model, opt, clip)
        theirs, ours = plain.state_dict(), model.state_dict()
        worst = max((ours[k] - v).abs().max().item() for k, v in theirs.items())
        assert worst == 0.0 if clip is None else worst <= 1e-6, worst
    finally:
        zeroinf.engine_of(model).close()
    torch.manual_seed(0)
    decoupled = build_model()
    decoupled_opt = torch.optim.AdamW(decoupled.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for step in range(4):
        x, y = global_batch(step)
        decoupled(x, y).backward()
        decoupled_opt.step()
        decoupled_opt.zero_grad()
    assert any(not torch.equal(v, decoupled.state_dict()[k]) for k, v in theirs.items())  # the test can tell


def test_adam_with_bf16_moments_is_placement_invariant(tmp_path) -> None:
    """The bf16-moment window runs Adam's update too: host and NVMe states end bitwise equal, and
    apart from AdamW's."""
    def run(optimizer: str, cls: type) -> dict[str, torch.Tensor]:
        folder = str(tmp_path / optimizer) if optimizer == "nvme" else None
        offload = zeroinf.OffloadConfig(optimizer=optimizer, moment_dtype="bf16", nvme_dir=folder)
        torch.manual_seed(0)
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
        opt = cls(model, lr=1e-3, weight_decay=0.1)
        try:
            for step in range(3):
                x, y = global_batch(step)
                opt.backward(model(x, y))
                opt.step()
                opt.zero_grad()
            return {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            zeroinf.engine_of(model).close()

    host, nvme, adamw = run("host", zeroinf.Adam), run("nvme", zeroinf.Adam), run("host", zeroinf.AdamW)
    assert all(torch.equal(host[k], nvme[k]) for k in host)
    assert any(not torch.equal(host[k], adamw[k]) for k in host)


def test_adam_with_decoupled_weight_decay_is_adamw() -> None:
    """torch.optim.Adam(decoupled_weight_decay=True) is AdamW; so is zeroinf.Adam's."""
    def weights(cls: type, **kwargs: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0))
        opt = cls(model, lr=1e-3, weight_decay=0.1, **kwargs)
        try:
            for step in range(2):
                opt.backward(model(*global_batch(step)))
                opt.step()
                opt.zero_grad()
            return {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            zeroinf.engine_of(model).close()

    decoupled, adamw = weights(zeroinf.Adam, decoupled_weight_decay=True), weights(zeroinf.AdamW)
    assert all(torch.equal(decoupled[k], v) for k, v in adamw.items())

