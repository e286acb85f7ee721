"""A consolidated checkpoint of a Hugging Face model loads with `from_pretrained` as it is (world 1,
stage 3): the checkpoint recorded the config, which consolidate writes beside the weights, and the
loaded model gives the trained weights and the same logits as the model that was saved. A model whose
parameters differ from the Hub's files (Mixtral's fused experts, GPT-NeoX's renamed head, Sarvam-MoE's
split qkv) is written in the Hub's layout, key for key and bitwise what transformers' own
`save_pretrained` writes of the same weights (checkpoint/hub_folder.py)."""

from __future__ import annotations

import os

import pytest
import torch

import zeroinf
import zeroinf.checkpoint as ck
from tests._hf import GLOBAL_BATCH, SEQ, VOCAB, build, needs_model_type


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_consolidated_weights_load_with_from_pretrained(tmp_path, arch: str) -> None:
    pytest.importorskip("transformers")
    model = zeroinf.shard(build(arch), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-2)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.backward(model(input_ids=tokens, labels=tokens).loss)
        opt.step()
        opt.zero_grad()
    ck.save(tmp_path / "ckpt", model, opt, step=2)
    out = str(tmp_path / "hf")
    index = ck.consolidate(tmp_path / "ckpt", out, dtype="fp32", max_shard_bytes=20_000)  # several files
    assert len(set(index["weight_map"].values())) > 1
    assert os.path.isfile(os.path.join(out, "config.json"))  # nothing copied by hand

    loaded = type(model).from_pretrained(out).eval()
    trained = {k: v.float() for k, v in model.state_dict().items()}  # gathered (a collective at stage 3)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    with torch.no_grad():
        model.eval()
        # the weights are bitwise equal; the kernels may differ (from_pretrained picks its attention)
        torch.testing.assert_close(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    zeroinf.engine_of(model).close()


def _step_and_save(model: torch.nn.Module, ckpt) -> dict[str, torch.Tensor]:
    """One AdamW step of sharded `model`, a checkpoint of it at `ckpt`; its trained state (gathered)."""
    opt = zeroinf.AdamW(model, lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt.backward(model(input_ids=tokens, labels=tokens).loss)
    opt.step()
    ck.save(ckpt, model, opt, step=1)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    zeroinf.engine_of(model).close()
    return trained


@pytest.mark.parametrize(
    "arch", ["mixtral", "gpt_neox", pytest.param("sarvam_moe", marks=needs_model_type("sarvam_moe"))]
)
def test_consolidated_weights_are_written_in_the_hub_layout(tmp_path, arch: str) -> None:
    pytest.importorskip("transformers")
    from tests.weights.test_hf_conversion import _build, _differences, _stored

    model = zeroinf.shard(_build(arch), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    trained = _step_and_save(model, tmp_path / "ckpt")
    ck.consolidate(tmp_path / "ckpt", tmp_path / "hf", dtype="fp32", max_shard_bytes=30_000)

    reference = _build(arch)
    reference.load_state_dict(trained)
    reference.save_pretrained(tmp_path / "by-hf")
    assert _differences(_stored(str(tmp_path / "hf")), _stored(str(tmp_path / "by-hf"))) == []
    assert not any(k.endswith(".experts.gate_up_proj") for k in _stored(str(tmp_path / "hf")))  # one per expert


def test_frozen_parameters_come_from_the_folder_they_were_loaded_from(tmp_path, caplog) -> None:
    """Frozen parameters sharded at stage 3 (here Mixtral's experts) are not in checkpoints: consolidate
    refuses such a checkpoint naming them, writes it without them when allowed (with a warning), and
    with `frozen_from` (the CLI's --frozen-from) takes them from the Hub folder the model was loaded
    from, through the model's conversions: the folder equals transformers' save_pretrained of the
    trained model."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tests.weights.test_hf_conversion import _build, _differences, _stored
    from zeroinf.checkpoint import CheckpointError
    from zeroinf.cli import main

    _build("mixtral").save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")

    def freeze_experts(model: torch.nn.Module) -> torch.nn.Module:
        for name, p in model.named_parameters():
            p.requires_grad_(".experts." not in name)
        return model

    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    model = zeroinf.from_pretrained(tmp_path / "pretrained", cfg, prepare=freeze_experts)
    model.train()
    trained = _step_and_save(model, tmp_path / "ckpt")

    with pytest.raises(CheckpointError, match=r"4 frozen parameters \(model.layers.0.mlp.experts.gate_up_proj"):
        ck.consolidate(tmp_path / "ckpt", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # refused before anything is written
    with caplog.at_level("WARNING", logger="zeroinf.checkpoint"):
        ck.consolidate(tmp_path / "ckpt", tmp_path / "without", dtype="fp32", allow_missing=True)
    assert "without the 4 frozen parameters" in caplog.text
    assert not any(".experts." in k for k in _stored(str(tmp_path / "without")))
    assert main(["consolidate", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--dtype", "fp32",
                 "--frozen-from", str(tmp_path / "pretrained"), "--max-shard-size", "30KB"]) == 0

    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained", dtype=torch.float32)
    reference.load_state_dict(trained)
    reference.save_pretrained(tmp_path / "by-hf")
    assert _differences(_stored(str(tmp_path / "hf")), _stored(str(tmp_path / "by-hf"))) == []


def test_a_peft_checkpoint_is_refused_naming_how_to_write_its_adapters(tmp_path) -> None:
    """A checkpoint of a peft model holds its adapters under peft's internal names and not its base
    (frozen, sharded at stage 3): consolidated with --allow-missing it became a file that neither peft
    nor transformers loads. Refused, naming the adapters and the way to their folder; the recipe the
    message gives writes a folder PeftModel.from_pretrained loads with the trained adapters."""
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from zeroinf.checkpoint import CheckpointError

    build("llama").save_pretrained(tmp_path / "base")

    def lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))

    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    model = zeroinf.from_pretrained(tmp_path / "base", cfg, prepare=lora)
    model.train()
    trained = {n: t for n, t in _step_and_save(model, tmp_path / "ckpt").items() if "lora_" in n}
    for allow_missing in (False, True):
        with pytest.raises(CheckpointError, match=r"peft model \(adapters \{'default': 'LORA'\}\).*save_pretrained"):
            ck.consolidate(tmp_path / "ckpt", tmp_path / "refused", allow_missing=allow_missing)
    # the recipe: the model built as trained, the checkpoint loaded, its adapters saved
    again = zeroinf.from_pretrained(tmp_path / "base", cfg, prepare=lora)
    zeroinf.load(tmp_path / "ckpt", again, zeroinf.AdamW(again, lr=1e-3))
    zeroinf.save_pretrained(again, tmp_path / "adapters")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapters")
    state = reloaded.state_dict()
    assert trained and all(torch.equal(state[n], t) for n, t in trained.items())
