"""`zeroinf.integrations.SFTTrainer` and `DPOTrainer` against plain TRL (tests/integrations/_trl_runs.py).

- Full fine-tune and LoRA through `peft_config=` (TRL adds the adapters in its constructor; the model
  is sharded after them: trainer.py [Note: sharding after the Trainer's constructor]), fp32: stages 0
  and 3 in one process and stage 3 at world 2 (spawned gloo ranks, one group for both) log the plain
  trainer's losses and grad norms and end with its trainable weights; the LoRA adapters saved by
  `save_model` load with `PeftModel.from_pretrained`. Tolerance: test_trainer.py's.
- SFTConfig's default `bf16=True` trains with `Config.param_dtype="bf16"` (no autocast): the losses
  of `Config(param_dtype="bf16")` with `bf16=False`, bitwise.
- A model sharded before `peft_config=` wraps it is refused, naming the two ways that work.
- DPO, stage 3, fp32: the full model against a reference model sharded at stage 3 (frozen), and LoRA
  against its own base with the adapters disabled, log the plain DPOTrainer's losses (whose
  reference is a plain model) and end with its trainable weights. DPOTrainer's constructor takes
  `ref_model` second: the zeroinf Trainer passes `args` by name.
- GRPO through the documented combination `class _(zeroinf.integrations.Trainer, trl.GRPOTrainer)`,
  stage 3: the same sampled completions (rewards per step) and the same weights as plain GRPO.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")

import zeroinf  # noqa: E402
from tests._harness import run_ranks  # noqa: E402
from tests._hf import build  # noqa: E402
from tests.integrations._trl_runs import (  # noqa: E402
    dpo_run,
    grpo_run,
    lora,
    run_plain,
    sft_config,
    sft_rank,
    text_rows,
    tokenizer,
    trained,
    zeroinf_trainer,
)
from tests.integrations.conftest import single_thread  # noqa: E402
from zeroinf.integrations import DPOTrainer, SFTTrainer, TrainerArgumentsError  # noqa: E402

RTOL, ATOL = 1e-5, 5e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integrations/conftest.py


def _assert_parity(ours: dict, plain: dict, where: str) -> None:
    assert plain["loss"] and sorted(ours["loss"]) == sorted(plain["loss"]), where
    for key in ("loss", "grad_norm"):
        for step, ref in plain[key].items():
            assert ours[key][step] == pytest.approx(ref, rel=RTOL), f"{where}: step {step} {key}"
    assert sorted(ours["trainable"]) == sorted(plain["trainable"]), where
    for name, ref in plain["trainable"].items():
        torch.testing.assert_close(
            ours["trainable"][name], ref, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{where}: {name}: {m}"
        )


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    with single_thread():  # module-scoped: runs before the function-scoped `one_thread`
        root = tmp_path_factory.mktemp("plain")
        runs = {name: run_plain(str(root / name), peft) for name, peft in (("full", False), ("lora", True))}
    assert runs["full"]["loss"][4] < runs["full"]["loss"][1] - 0.1, "the reference run must learn something"
    return runs


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_matches_plain_sft_trainer(tmp_path, plain, stage: int, method: str) -> None:
    trainer = zeroinf_trainer(str(tmp_path), method == "lora", stage)
    ours = trained(trainer)
    _assert_parity(ours, plain[method], f"{method} stage {stage}")
    assert isinstance(trainer.optimizer, zeroinf.AdamW)
    assert zeroinf.engine_of(trainer.model).cfg.stage == stage
    if method == "lora":
        assert all("lora_" in name for name in ours["trainable"]), sorted(ours["trainable"])


def test_world2_matches_plain_and_saves_loadable_adapters(tmp_path, plain) -> None:
    from peft import PeftModel

    ranks = run_ranks(sft_rank, 2, str(tmp_path), timeout_s=300)
    for method in ("full", "lora"):
        _assert_parity(ranks[0][method], plain[method], f"{method} world 2")
    folder = tmp_path / "adapters"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(folder))
    state = PeftModel.from_pretrained(build("llama"), str(folder)).state_dict()
    for name, ref in plain["lora"]["trainable"].items():
        torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=name)


def test_the_default_bf16_sets_the_compute_dtype_without_autocast(tmp_path) -> None:
    flagged = zeroinf_trainer(str(tmp_path / "flag"), False, 3, bf16=None)  # SFTConfig's default: bf16=True
    assert flagged.accelerator.mixed_precision == "no"  # no autocast over the bf16 parameters
    assert zeroinf.engine_of(flagged.model).cfg.param_dtype == "bf16"
    assert flagged.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    torch.manual_seed(0)
    configured = SFTTrainer(model=build("llama"), args=sft_config(str(tmp_path / "cfg")), train_dataset=text_rows(),
                            processing_class=tokenizer(),
                            zeroinf_config=zeroinf.Config(stage=3, param_dtype="bf16", persist_threshold_bytes=0,
                                                          split_root_min_bytes=0))
    assert trained(flagged)["loss"] == trained(configured)["loss"]


def test_a_model_sharded_before_peft_config_is_refused(tmp_path) -> None:
    model = zeroinf.shard(build("llama"), zeroinf.Config(stage=3))
    with pytest.raises(TrainerArgumentsError, match="wrapped the model after it was sharded.*prepare=lambda m"):
        SFTTrainer(model=model, args=sft_config(str(tmp_path)), train_dataset=text_rows(),
                   processing_class=tokenizer(), peft_config=lora())


@pytest.mark.parametrize("method", ["full", "lora"])
def test_dpo_matches_plain_dpo_trainer(tmp_path, method: str) -> None:
    import trl

    peft = method == "lora"
    plain = dpo_run(trl.DPOTrainer, str(tmp_path / "plain"), peft, None if peft else build("llama"))
    assert plain["loss"][4] < plain["loss"][1] - (1e-3 if peft else 0.05), "the reference run must learn something"
    stage3 = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    ref = None if peft else zeroinf.shard(build("llama").requires_grad_(False), stage3)
    ours = dpo_run(DPOTrainer, str(tmp_path / "ours"), peft, ref, zeroinf_config=stage3)
    _assert_parity(ours, plain, f"DPO {method}")


def test_a_model_folder_is_loaded_sharded_with_its_adapters_and_reference(tmp_path, monkeypatch) -> None:
    """`model="folder"`: TRL would load it whole with transformers (and DPO its reference too); here
    zeroinf.from_pretrained loads both sharded (TRL's loader is made to fail), LoRA's adapters drawn
    after TRL's set_seed: the plain trainers' losses and weights, loading the folder whole."""
    import trl
    import trl.trainer.dpo_trainer
    import trl.trainer.sft_trainer

    folder = str(tmp_path / "llama")
    build("llama").save_pretrained(folder)
    plain_sft = trained(trl.SFTTrainer(model=folder, args=sft_config(str(tmp_path / "ps")), train_dataset=text_rows(),
                                       processing_class=tokenizer(), peft_config=lora()))
    plain_dpo = dpo_run(trl.DPOTrainer, str(tmp_path / "pd"), False, model=folder)

    def whole(*args, **kwargs):
        raise AssertionError("TRL loaded the model whole")

    for module in (trl.trainer.sft_trainer, trl.trainer.dpo_trainer):
        monkeypatch.setattr(module, "create_model_from_path", whole)
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, split_root_min_bytes=0)
    sft = SFTTrainer(model=folder, args=sft_config(str(tmp_path / "zs")), train_dataset=text_rows(),
                     processing_class=tokenizer(), peft_config=lora(), zeroinf_config=cfg)
    _assert_parity(trained(sft), plain_sft, "SFT LoRA from a folder")
    ours_dpo = dpo_run(DPOTrainer, str(tmp_path / "zd"), False, model=folder, zeroinf_config=cfg)
    assert zeroinf.engine_of(ours_dpo["trainer"].ref_model).cfg.stage == 3  # the reference, sharded and frozen
    _assert_parity(ours_dpo, plain_dpo, "DPO from a folder")


def test_grpo_through_the_trainer_combination_matches_plain_grpo(tmp_path) -> None:
    import trl

    from zeroinf.integrations import Trainer

    class GRPOTrainer(Trainer, trl.GRPOTrainer):
        pass

    plain = grpo_run(trl.GRPOTrainer, str(tmp_path / "plain"))
    assert len(set(plain["reward"].values())) > 1, "the completions must change as the model trains"
    ours = grpo_run(GRPOTrainer, str(tmp_path / "ours"), zeroinf_config=zeroinf.Config(
        stage=3, persist_threshold_bytes=0, split_root_min_bytes=0))
    assert ours["reward"] == plain["reward"]
    _assert_parity(ours, plain, "GRPO")
