"""PEFT methods beyond LoRA on a sharded model, against plain PyTorch + peft (world 2, one spawned group).

- VB-LoRA shares one `vblora_vector_bank` (an `nn.ParameterDict`) among every adapted layer: owned by
  the first layer's unit, the other layers read an empty placeholder at stage 3 ("index is out of
  bounds"); now it trains at stage 3 with parameters on NVMe at parity (partition/wrap.py [Note: a
  parameter held in several units through a container]).
- `zeroinf.save_pretrained` of VeRA (projections saved as buffers) and VB-LoRA (the bank under its
  model-level name) stopped in peft's own save; now `PeftModel.from_pretrained` of the folder gives the
  trained model's logits.
- `merge_and_unload()` at stage 3 lost every merge silently (LoRA's in-place `+=` and IA3's `p.data =`
  both wrote empty placeholders); now the merged model's logits equal the unmerged one's, and
  `zeroinf.save_pretrained(merged)` equals peft's merge of the reference, key for key
  (integrations/peft_layers.py [Note: merge_and_unload at stage 3]).
- AdaLoRA, and prefix tuning with activation checkpointing (which peft refuses too), are refused at
  `shard`, naming why and what to use ([Note: AdaLoRA]).
- `p.data = t` inside `zeroinf.gathered`: kept with `modify=True`, refused with `modify=False`.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._hf import rank_rows, train_causal_lm
from tests.partition._construction import VOCAB, build

STEPS, GLOBAL_BATCH, LR = 3, 4, 1e-2
TARGETS = ["q_proj", "v_proj"]
# fp32, world 2 against one process: the foundation's tolerances (tests/test_parity.py)
RTOL, ATOL = 1e-5, 5e-5


def _config(method: str) -> Any:
    import peft

    return {
        "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
        "ia3": lambda: peft.IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        ),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=TARGETS),
        "vblora": lambda: peft.VBLoRAConfig(r=4, num_vectors=16, vector_length=8, target_modules=TARGETS),
        "adalora": lambda: peft.AdaLoraConfig(init_r=6, target_r=3, total_step=10, target_modules=TARGETS),
        "prefix": lambda: peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"),
    }[method]()


def _prepare(method: str) -> Any:
    from peft import get_peft_model

    def prepare(model: torch.nn.Module) -> Any:
        torch.manual_seed(0)  # the adapters draw the same numbers in both runs
        return get_peft_model(model, _config(method))

    return prepare


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, 12), generator=torch.Generator().manual_seed(step))


def _reference(path: str, method: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = _prepare(method)(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=_batch(step), labels=_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_batch(99)).logits
    merged = model.merge_and_unload() if method in ("lora", "ia3") else None
    return {"losses": losses, "logits": logits, "merged": None if merged is None else merged.state_dict()}


def _train(rank: int, world: int, path: str, method: str, cfg: zeroinf.Config, root: str) -> dict[str, Any]:
    model = zeroinf.from_pretrained(path, cfg, prepare=_prepare(method))
    opt = zeroinf.AdamW(model, lr=LR)
    losses = train_causal_lm(model, opt, lambda step: rank_rows(_batch(step), rank, world), STEPS, world)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_batch(99)).logits
    out: dict[str, Any] = {"losses": losses, "logits": logits, "adapters": os.path.join(root, f"{method}-adapters")}
    zeroinf.save_pretrained(model, out["adapters"])
    if method in ("lora", "ia3"):
        with pytest.raises(ValueError, match="still holds adapter layers"):
            zeroinf.save_pretrained(model.get_base_model(), os.path.join(root, "refused"))
        merged = model.merge_and_unload()
        with torch.no_grad():
            out["merged_logits"] = merged(input_ids=_batch(99)).logits
        out["merged"] = os.path.join(root, f"{method}-merged")
        zeroinf.save_pretrained(merged, out["merged"])
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def _data_assignment_in_gathered(path: str, root: str) -> dict[str, Any]:
    model = zeroinf.from_pretrained(path, zeroinf.Config(stage=3, persist_threshold_bytes=0))
    weight = model.model.layers[0].mlp.up_proj.weight
    with zeroinf.gathered([weight], modify=True):
        new = torch.full_like(weight, 0.25)
        weight.data = new  # a tensor of its own, as peft's IA3 and DoRA merges assign
    with zeroinf.gathered([weight]):
        kept = bool((weight == 0.25).all())
    refused = ""
    try:
        with zeroinf.gathered([weight]):
            weight.data = torch.zeros_like(weight)
    except RuntimeError as e:
        refused = str(e)
    with zeroinf.gathered([weight]):
        unchanged = bool((weight == 0.25).all())
    zeroinf.engine_of(model).close()
    return {"kept": kept, "refused": refused, "unchanged_after_refusal": unchanged}


def _refusal(path: str, method: str, cfg: zeroinf.Config) -> str:
    try:
        zeroinf.from_pretrained(path, cfg, prepare=_prepare(method))
    except NotImplementedError as e:
        return str(e)
    return ""


def _ranks(rank: int, world: int, path: str, root: str) -> dict[str, Any]:
    nvme = os.path.join(root, f"swap{rank}")
    os.makedirs(nvme, exist_ok=True)
    on_nvme = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=nvme)
    stage3_nvme = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=on_nvme)
    return {
        "vblora": _train(rank, world, path, "vblora", stage3_nvme, root),
        "vera": _train(rank, world, path, "vera", zeroinf.Config(stage=2), root),
        "lora": _train(rank, world, path, "lora", stage3_nvme, root),
        "ia3": _train(rank, world, path, "ia3", zeroinf.Config(stage=3, persist_threshold_bytes=0), root),
        "data_assignment": _data_assignment_in_gathered(path, root),
        "adalora": _refusal(path, "adalora", zeroinf.Config(stage=2)),
        "prefix_checkpointed": _refusal(path, "prefix", zeroinf.Config(stage=3, activation_checkpointing=True)),
    }


@pytest.fixture(scope="module")
def results() -> tuple[dict[str, dict[str, Any]], dict[str, Any], str]:
    root = tempfile.mkdtemp(prefix="zeroinf-peft-")
    path = os.path.join(root, "llama")
    build("llama", seed=5).save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    references = {m: _reference(path, m) for m in ("vblora", "vera", "lora", "ia3")}
    return references, run_ranks(_ranks, 2, path, root, timeout_s=300)[0], path


@pytest.mark.parametrize("method", ["vblora", "vera", "lora", "ia3"])
def test_trains_like_plain_pytorch_and_its_saved_adapters_reload(results: tuple, method: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    references, ours, path = results
    ref, got = references[method], ours[method]
    assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=RTOL, atol=ATOL)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, got["adapters"])
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=_batch(99)).logits, ref["logits"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_merge_and_unload_at_stage_3_merges_and_saves_as_peft_does(results: tuple, method: str) -> None:
    from safetensors.torch import load_file

    references, ours, _ = results
    ref, got = references[method], ours[method]
    # the merge reached the weights: the merged model computes what the adapted one did
    torch.testing.assert_close(got["merged_logits"], got["logits"], rtol=RTOL, atol=ATOL)
    saved = load_file(os.path.join(got["merged"], "model.safetensors"))
    expected = {k: v for k, v in ref["merged"].items() if k != "lm_head.weight" or k in saved}
    assert sorted(saved) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=RTOL, atol=ATOL, msg=name)
    assert os.path.isfile(os.path.join(got["merged"], "config.json"))


def test_data_assignment_inside_gathered(results: tuple) -> None:
    got = results[1]["data_assignment"]
    assert got["kept"], "p.data = t inside gathered(modify=True) was lost"
    assert "given a new tensor" in got["refused"] and "modify=True" in got["refused"], got["refused"]
    assert got["unchanged_after_refusal"]


def test_adalora_and_checkpointed_prefix_tuning_are_refused_with_the_alternatives(results: tuple) -> None:
    message = results[1]["adalora"]
    assert "AdaLoRA" in message and "p.grad" in message and "LoRA" in message, message
    message = results[1]["prefix_checkpointed"]
    assert "prefix tuning" in message and "activation_checkpointing=False" in message, message
