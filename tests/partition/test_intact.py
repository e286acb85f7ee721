"""partition/intact.py: in-place writes to a sharded model's parameters outside the engine.

World 1 in process, the tiny GPT of tests/_parity.py, stages 0-2 in bf16 and 3 in fp32. A write
through the parameters themselves between steps (`with torch.no_grad(): p.clamp_(...)`,
`model.apply(init_fn)`) used to be lost without a word (3e-3 off the plain loop at stages 0-1, 1.0
at stage 3); the next forward and
`zeroinf.save` now refuse it, naming the parameter and `zeroinf.gathered(..., modify=True)`. The
same write inside such a block trains on (and bitwise as PyTorch: tests/partition/test_gathered.py);
a write inside a read block is refused at the block's end. Version bumps the model's own code makes while it
runs (peft's LoRA on a bare parameter, in forward and in a checkpointed recompute) are not refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import zeroinf
from tests._parity import LR, build_model, global_batch


@pytest.fixture(params=[0, 1, 2, 3], ids=lambda s: f"stage{s}")
def trained(request: pytest.FixtureRequest) -> Iterator[tuple[nn.Module, zeroinf.AdamW]]:
    """Placements that lose such writes: bf16 at stages 0-2 (in fp32 the owned range of the
    parameters is the master, and the write is kept: tests/optim/test_masters_in_memory_shard.py)."""
    stage = request.param
    torch.manual_seed(0)
    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, param_dtype="fp32" if stage == 3 else "bf16")
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    _train_step(model, opt, 0)
    yield model, opt
    zeroinf.engine_of(model).close()


def _train_step(model: nn.Module, opt: zeroinf.AdamW, step: int) -> None:
    x, y = global_batch(step)
    opt.backward(model(x, y))
    opt.step()
    opt.zero_grad()


def _clamp(p: torch.Tensor) -> None:
    p.clamp_(-0.05, 0.05)


def _init_normal(p: torch.Tensor) -> None:
    nn.init.normal_(p, std=0.02)


@pytest.mark.parametrize("write", [_clamp, _init_normal], ids=["clamp", "nn.init"])
def test_a_write_outside_gathered_is_refused_at_the_next_forward_and_save(
    trained: tuple[nn.Module, zeroinf.AdamW], write: Callable[[torch.Tensor], None], tmp_path: object
) -> None:
    model, opt = trained
    with torch.no_grad():
        write(model.blocks[0].qkv.weight)
    x, y = global_batch(1)
    with pytest.raises(RuntimeError, match=r"parameter blocks\.0\.qkv\.weight was written in place .*gathered"):
        model(x, y)
    with pytest.raises(RuntimeError, match="written in place"):
        zeroinf.save(str(tmp_path), model, opt, step=1)


def test_model_apply_of_an_init_function_is_refused(trained: tuple[nn.Module, zeroinf.AdamW]) -> None:
    model, _ = trained

    def init_fn(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    model.apply(init_fn)
    x, y = global_batch(1)
    with pytest.raises(RuntimeError, match="model.apply"):
        model(x, y)


def test_the_same_write_inside_gathered_trains_on(trained: tuple[nn.Module, zeroinf.AdamW]) -> None:
    model, opt = trained
    with zeroinf.gathered(list(model.parameters()), modify=True):
        for p in model.parameters():
            _clamp(p)
    _train_step(model, opt, 1)
    _train_step(model, opt, 2)
    with zeroinf.gathered(model.head.weight):
        assert model.head.weight.float().abs().max().item() <= 0.05 + 3 * LR  # clamped, then two Adam steps


def test_a_write_inside_a_read_block_is_refused(trained: tuple[nn.Module, zeroinf.AdamW]) -> None:
    """Stage 3 drops the uncommitted write with the gathered copy and trains on; stages 0-2 keep the
    copy whole, so it still holds the write and the next forward refuses it too."""
    model, opt = trained
    weight = model.blocks[0].qkv.weight  # a unit stage 3 shards (the root unit stays whole)
    with zeroinf.gathered(weight):
        before = weight.clone()
    with pytest.raises(RuntimeError, match=r"written in place inside zeroinf\.gathered\(\.\.\., modify=False\)"):
        with zeroinf.gathered(weight):
            with torch.no_grad():
                weight.zero_()
    if zeroinf.engine_of(model).cfg.stage == 3:
        with zeroinf.gathered(weight):
            assert torch.equal(weight, before)
        _train_step(model, opt, 1)
    else:
        with pytest.raises(RuntimeError, match="written in place after zeroinf.shard"):
            _train_step(model, opt, 1)


def test_a_read_nested_in_a_write_block_leaves_its_writes_to_the_enclosing_block(
    trained: tuple[nn.Module, zeroinf.AdamW],
) -> None:
    model, opt = trained
    weight = model.blocks[0].qkv.weight
    with zeroinf.gathered(weight, modify=True):
        with torch.no_grad():
            weight.fill_(0.25)
        with zeroinf.gathered(weight):  # found by the gathered fuzz: this read's end refused the write
            pass
    with zeroinf.gathered(weight):
        assert bool((weight == 0.25).all())
    _train_step(model, opt, 1)


def test_training_and_reading_never_count_as_writes(trained: tuple[nn.Module, zeroinf.AdamW], tmp_path: object) -> None:
    """Steps, gathers for reading, state_dict and save leave the version counters alone."""
    model, opt = trained
    for step in range(1, 4):
        _train_step(model, opt, step)
        with zeroinf.gathered(list(model.parameters())):
            pass
        model.state_dict()
    zeroinf.save(str(tmp_path), model, opt, step=3)
    with torch.no_grad():
        model(*global_batch(4))


class _Router(nn.Module):
    """An MoE router's shape: a bare parameter, not an nn.Linear (peft wraps it in a ParamWrapper)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class _RoutedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.router, self.out = _Router(d), nn.Linear(8, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.router(x)))


class _Routed(nn.Module):
    """Blocks, so that the router's frozen base weight shares a sharded unit with trainable ones."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList([_RoutedBlock(d) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_writes_the_model_makes_while_it_runs_are_not_refused(checkpointing: bool) -> None:
    """peft's LoRA on a bare parameter registers a torch parametrization in every forward (and in
    the recompute of a checkpointed backward), whose `set_` bumps the frozen base weight's version
    counter without writing a value: it used to be refused at the next forward as a write between
    steps. It trains as the plain peft model does (stage 3, frozen units sharded on the host), and a
    real write between steps is still refused."""
    import copy

    from tests._hf import peft_lora_on_parameters

    peft = pytest.importorskip("peft")
    if not peft_lora_on_parameters():
        pytest.skip(f"peft {peft.__version__} has no LoRA on bare parameters (target_parameters)")
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, target_parameters=["router.weight"], init_lora_weights=False)
    plain = peft.get_peft_model(_Routed(), lora)
    assert type(plain.base_model.model.blocks[0].router).__name__ == "ParamWrapper"
    offload = zeroinf.OffloadConfig(params="host")
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, activation_checkpointing=checkpointing, offload=offload)
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    plain_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    opt = zeroinf.AdamW(model, lr=1e-2)
    for step in range(3):
        x = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step))
        expected = nn.functional.cross_entropy(plain(x).flatten(0, 1), x.roll(1, 1).flatten())
        expected.backward()
        plain_opt.step(), plain_opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
        opt.backward(loss)
        opt.step(), opt.zero_grad()
        assert loss.item() == expected.item(), step
    with torch.no_grad():
        model.base_model.model.head.weight.clamp_(-0.01, 0.01)
    with pytest.raises(RuntimeError, match=r"head\.weight was written in place"):
        model(x)
    zeroinf.engine_of(model).close()
