"""Partition at construction: `zeroinf.init()` + `zeroinf.shard` build the model unit by unit.

- the weights equal a plain build after the same seed (init through reset_parameters),
- `init_fn` runs on every module while its unit is unsharded,
- on 2 ranks, a model whose fp32 size is 3x the memory the build may add to a process is built
  (peak RSS measured with the kernel's high-water mark, reset before the build) and trains a step:
  the test's own block model, and a Hugging Face Llama.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zeroinf
from tests._harness import run_ranks


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 32, n_blocks: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_init_matches_plain_construction_for_every_stage() -> None:
    torch.manual_seed(7)
    plain = _full_state(Net())
    for stage in (0, 2, 3):
        torch.manual_seed(7)
        with zeroinf.init():
            model = Net()
        assert all(p.is_meta for p in model.parameters())
        zeroinf.shard(model, zeroinf.Config(stage=stage, persist_threshold_bytes=0))
        got = _full_state(model)
        assert got.keys() == plain.keys()
        for k in plain:
            torch.testing.assert_close(got[k], plain[k], rtol=0, atol=0, msg=f"stage {stage}: {k}")


def test_init_fn_runs_per_module_while_unsharded() -> None:
    seen: list[str] = []

    def init_fn(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.fill_(0.5)  # must be the real, unsharded weight
            seen.append(type(module).__name__)

    with zeroinf.init():
        model = Net()
    zeroinf.shard(model, zeroinf.Config(stage=3, persist_threshold_bytes=0), init_fn=init_fn)
    state = model.state_dict()
    assert len(seen) == 9  # 4 blocks x 2 Linear + head
    matrices = [k for k in state if k.endswith("weight") and "norm" not in k and "emb" not in k]
    assert all(bool((state[k] == 0.5).all()) for k in matrices)


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size to the current one


def _llama(n_layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=384, intermediate_size=1024, num_hidden_layers=n_layers,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
    )


def _make(kind: str, size: int) -> nn.Module:
    return Net(d=size, n_blocks=64) if kind == "net" else _llama(size)


def _logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    return out if isinstance(out, torch.Tensor) else out.logits


def _build_big(rank: int, world: int, kind: str, size: int) -> dict:
    cfg = zeroinf.Config(stage=3, param_dtype="bf16", persist_threshold_bytes=0)
    with zeroinf.init(cfg):  # warm-up: first-use costs (lazy imports, kernels) are not the model's
        warm = _make(kind, 8 if kind == "net" else 2)
    zeroinf.shard(warm, cfg)
    del warm
    _reset_peak_rss()
    before = _peak_rss_bytes()
    with zeroinf.init(cfg):
        model = _make(kind, size)
    model_fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
    zeroinf.shard(model, cfg)
    build_peak = _peak_rss_bytes() - before
    opt = zeroinf.AdamW(model, lr=1e-3)
    idx = torch.randint(0, 50, (2, 8))
    loss = _logits(model, idx).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    step_peak = _peak_rss_bytes() - before
    return {"model_fp32_bytes": model_fp32_bytes, "build_peak": build_peak, "step_peak": step_peak,
            "loss": loss.item()}


def _check_bounded(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        limit = r["model_fp32_bytes"] / 3
        assert r["build_peak"] < limit, (
            f"rank {rank}: building added {r['build_peak'] / 2**20:.0f} MiB of RSS, more than a third of the "
            f"{r['model_fp32_bytes'] / 2**20:.0f} MiB fp32 model"
        )
        assert torch.isfinite(torch.tensor(r["loss"]))
    print({k: round(v / 2**20, 1) for k, v in results[0].items() if k.endswith(("bytes", "peak"))})


def _needs_clear_refs() -> None:
    if not os.path.exists("/proc/self/clear_refs"):
        import pytest

        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")


def test_build_under_init_bounded_memory_two_ranks() -> None:
    _needs_clear_refs()
    # 64 units of 0.6M params (d 384): the fp32 model is 151 MB
    _check_bounded(run_ranks(_build_big, 2, "net", 384, timeout_s=240))


def test_build_hugging_face_llama_under_init_bounded_memory_two_ranks() -> None:
    """The same bound for a Hugging Face Llama, whose post_init touches every parameter after its
    layers are parked: 32 layers of 1.6M params, the fp32 model is 207 MB."""
    _needs_clear_refs()
    _check_bounded(run_ranks(_build_big, 2, "llama", 32, timeout_s=240))


RESIZED_ARCHS = ("llama", "llama-tied", "gpt2")


def _resized_under_init(rank: int, world: int) -> dict[str, tuple[float, list[int]]]:
    from tests import _hf

    out = {}
    for arch in RESIZED_ARCHS:
        torch.manual_seed(0)
        plain = _hf.build(arch)
        plain.resize_token_embeddings(140)
        cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0)
        with zeroinf.init(cfg):
            model = _hf.build(arch)
            model.resize_token_embeddings(140)  # draws the new rows as a plain resize does
        zeroinf.shard(model, cfg)
        state = model.state_dict()
        diff = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
        weight = model.get_input_embeddings().weight
        shape = list(getattr(weight, "ds_shape", weight.shape))  # a sharded embedding's full shape
        zeroinf.engine_of(model).close()
        out[arch] = (diff, shape)
    return out


def test_resize_token_embeddings_inside_init_matches_a_plain_resize() -> None:
    """Llama, Llama with tied embeddings and GPT-2, in one group of 2 ranks."""
    for rank, per_arch in enumerate(run_ranks(_resized_under_init, 2)):
        for arch, (diff, shape) in per_arch.items():
            assert diff == 0.0 and shape == [140, 32], (arch, rank, diff, shape)
        assert set(per_arch) == set(RESIZED_ARCHS)


@pytest.mark.parametrize("stage", [0, 3])
def test_resize_after_shard_is_refused_with_the_fix(stage: int) -> None:
    """After `shard` the engine's buffers cannot follow a new size (at stage 3 the old rows were not
    even there to copy): the next forward names the resize and where to do it instead; it blamed a
    dtype or device conversion before."""
    from tests import _hf

    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, split_root_min_bytes=0)
    model = zeroinf.shard(_hf.build("llama"), cfg)
    model.resize_token_embeddings(140)
    # at stage 3 the embedding is a unit of its own (split_root): the resize read its (0, 0) placeholder
    with pytest.raises(RuntimeError, match=r"embed_tokens.weight has shape \(140, (32|0)\).*resized after zeroinf"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    zeroinf.engine_of(model).close()


def test_peft_adapters_added_after_the_init_block_are_refused_and_inside_it_are_exact() -> None:
    """Between the `with zeroinf.init()` block and `shard`, parked parameters report the meta device,
    and peft's get_peft_model moves each adapter to its base layer's device: the adapters' values went
    to meta and `reset_parameters` stood in for them at `shard`, silently (LoRA's B no longer zero).
    Refused, naming the adapter and the fix; inside the block the adapters are those of eager peft."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from tests import _hf

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    with zeroinf.init(cfg):
        late = _hf.build("llama")
    late = get_peft_model(late, lora)
    with pytest.raises(RuntimeError, match=r"q_proj.lora_A.default.weight and 7 more is on the meta device.*inside "):
        zeroinf.shard(late, cfg)

    with zeroinf.init(cfg):
        inside = _hf.build("llama")
        torch.manual_seed(1)
        inside = get_peft_model(inside, lora)
    eager = _hf.build("llama")
    torch.manual_seed(1)
    eager = get_peft_model(eager, lora)
    got, want = _full_state(zeroinf.shard(inside, cfg)), _full_state(zeroinf.shard(eager, cfg))
    assert sorted(got) == sorted(want) and any("lora_B" in name for name in want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _normal_head(model: nn.Module) -> None:
    with torch.no_grad():
        nn.init.normal_(model.lm_head.weight)


def _zeros_through_data(model: nn.Module) -> None:
    model.lm_head.weight.data = torch.zeros_like(model.lm_head.weight)  # zeros_like of a placeholder: meta


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_normal_head, "lm_head.weight was written in place"),
        (lambda model: model.apply(model._init_weights), "embed_tokens.weight was written in place"),
        (lambda model: model.half(), "embed_tokens.weight was converted from torch.float32 to torch.float16"),
        (_zeros_through_data, r"lm_head.weight was given new data \(`p.data = ...`\)"),
        (lambda model: model.to_empty(device="cpu"), r"embed_tokens.weight was replaced"),
    ],
)
def test_changes_between_the_init_block_and_shard_are_refused(change, message) -> None:
    """Between the block and `shard` the parameters are parked meta placeholders: an in-place write
    (nn.init, Hugging Face's `_init_weights` through model.apply) did nothing, a conversion changed
    only the placeholder's dtype, `p.data = torch.zeros_like(p)` gave it another placeholder and
    `to_empty` (what PyTorch's error for `model.to(device)` there suggests) uninitialized memory, and
    `shard` went on with the values of the block, silently."""
    from tests import _hf

    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    with zeroinf.init(cfg):
        model = _hf.build("llama")
    change(model)
    with pytest.raises(RuntimeError, match=f"{message} after the `with zeroinf.init\\(\\)` block.*inside the block"):
        zeroinf.shard(model, cfg)


def test_exact_masters_before_the_optimizer(tmp_path) -> None:
    """`zeroinf.init(cfg, exact_masters=True)` (partition/park.py [Note: exact masters under
    zeroinf.init]): the park keeps the fp32 values past `shard`; an edit in `gathered(modify=True)`
    before the optimizer lands in the masters over them (only the edited elements differ from
    eager's unrounded masters), and the park closes once the optimizer took them; a model dropped
    before any optimizer, or whose engine is closed, frees what was kept (the NVMe park file goes)."""
    from tests.partition._construction import build

    cfg = zeroinf.Config(
        stage=3, param_dtype="bf16", persist_threshold_bytes=0,
        offload=zeroinf.OffloadConfig(params="nvme", nvme_dir=str(tmp_path)),
    )

    def masters(model: nn.Module) -> torch.Tensor:
        opt = zeroinf.AdamW(model, lr=0.0)
        out = torch.cat([opt.states.read_unit(ui).master for ui in range(len(zeroinf.engine_of(model).units))])
        opt.close()
        return out

    torch.manual_seed(0)
    eager = zeroinf.shard(build("llama"), cfg)
    eager_masters = masters(eager)
    zeroinf.engine_of(eager).close()
    torch.manual_seed(0)
    with zeroinf.init(cfg, exact_masters=True) as park:
        model = build("llama")
    zeroinf.shard(model, cfg)
    assert park.kept_keys and not park.closed
    weight = next(p for p in model.parameters() if p.dim() == 2)
    with zeroinf.gathered([weight], modify=True):
        weight[0, :5] = 1.0
    got = masters(model)
    assert park.closed and not park.kept_keys
    assert int((got != eager_masters).sum()) == 5 and int((got == 1.0).sum()) >= 5
    zeroinf.engine_of(model).close()

    with zeroinf.init(cfg, exact_masters=True) as dropped_park:
        dropped = build("llama")
    zeroinf.shard(dropped, cfg)
    assert any("park" in f for f in os.listdir(tmp_path))
    del dropped
    import gc

    gc.collect()
    assert dropped_park.closed and not dropped_park.kept_keys
    assert not any("park" in f for f in os.listdir(tmp_path))
    # closing the engine lets them go too, the model still referenced
    with zeroinf.init(cfg, exact_masters=True) as closed_park:
        closed = build("llama")
    zeroinf.shard(closed, cfg)
    zeroinf.engine_of(closed).close()
    assert closed_park.closed and not any("park" in f for f in os.listdir(tmp_path))
