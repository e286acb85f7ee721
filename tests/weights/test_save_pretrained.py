"""`zeroinf.save_pretrained`: a sharded model saved as a Hugging Face folder that Hugging Face loads.

World 2 (one spawned group), stage 3, parameters on NVMe, a tiny Llama trained one step:
- the model: the folder (config, generation config, weights split into several files with an
  index) loads with `AutoModelForCausalLM.from_pretrained` to the sharded model's gathered weights,
  bitwise; each sharded unit is gathered once (one unit in memory at a time);
- a peft LoRA model: the folder loads with `PeftModel.from_pretrained` to the same adapters, and
  only the units holding trainable parameters are gathered, never the frozen base.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests import _hf
from tests._harness import run_ranks


def _train_one_step(model: torch.nn.Module, rank: int) -> None:
    opt = zeroinf.AdamW(model, lr=1e-2)
    x = torch.randint(0, _hf.VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    opt.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    opt.zero_grad()
    opt.close()


def _cfg(root: str, name: str, rank: int) -> zeroinf.Config:
    folder = os.path.join(root, f"{name}-swap{rank}")
    os.makedirs(folder, exist_ok=True)
    offload = zeroinf.OffloadConfig(params="nvme", nvme_dir=folder)
    return zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)


def _gathers(model: torch.nn.Module) -> int:
    return int(zeroinf.engine_of(model).counter.total["all_gather"])


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {}
    model = zeroinf.shard(_hf.build("llama"), _cfg(root, "model", rank))
    _train_one_step(model, rank)
    engine = zeroinf.engine_of(model)
    before = _gathers(model)
    zeroinf.save_pretrained(model, os.path.join(root, "model"), max_shard_bytes=20_000)
    out["model_gathers"] = _gathers(model) - before
    out["model_sharded_units"] = sum(not u.resident for u in engine.all_units)
    state = model.state_dict()
    back = AutoModelForCausalLM.from_pretrained(os.path.join(root, "model"), dtype=torch.float32).state_dict()
    out["model_equal"] = back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())
    out["model_files"] = sorted(os.listdir(os.path.join(root, "model")))
    with open(os.path.join(root, "model", "config.json")) as f:
        out["architectures"] = json.load(f).get("architectures")
    engine.close()

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = zeroinf.shard(get_peft_model(_hf.build("llama"), lora), _cfg(root, "peft", rank))
    _train_one_step(peft_model, rank)
    engine = zeroinf.engine_of(peft_model)
    before = _gathers(peft_model)
    zeroinf.save_pretrained(peft_model, os.path.join(root, "peft"))
    out["peft_gathers"] = _gathers(peft_model) - before
    out["peft_trainable_units"] = sum(not u.resident for u in engine.units)
    state = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    back = PeftModel.from_pretrained(_hf.build("llama"), os.path.join(root, "peft")).state_dict()
    out["peft_equal"] = len(state) > 0 and all(torch.equal(back[k], v) for k, v in state.items())
    engine.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-save-pretrained-") as root:
        return run_ranks(run, 2, root, timeout_s=240)


def test_the_folder_loads_in_hugging_face_to_the_same_weights(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["model_equal"], (rank, r)
        files = r["model_files"]
        assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(files), files
        assert sum(f.endswith(".safetensors") for f in files) > 1, files
        assert r["model_gathers"] == r["model_sharded_units"], (rank, r)  # each unit once
        assert r["architectures"] == ["LlamaForCausalLM"], r["architectures"]  # as save_pretrained sets it


def test_a_peft_model_saves_its_adapters_without_gathering_the_base(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["peft_equal"], (rank, r)
        assert 0 < r["peft_gathers"] <= r["peft_trainable_units"], (rank, r)
