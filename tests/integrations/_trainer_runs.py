"""Tiny causal-LM runs through `transformers.Trainer` and `zeroinf.integrations.Trainer`, same seed and data.

The oracle is the plain Trainer in one process (torch AdamW fused, its own clipping, DDP-free): the
zeroinf Trainer must log the same losses and end with the same weights. The data is learnable
(arithmetic sequences), so the losses fall and the weights move measurably in a few steps.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests._hf import VOCAB, build

SEQ = 16
ROWS = 32  # 8 batches of 4 (world 1) = 4 optimizer steps of 2 micro-batches per epoch


class ArithmeticSequences(torch.utils.data.Dataset):
    """Row i: start s_i, stride k_i, tokens (s_i + k_i * t) % VOCAB; labels = input_ids."""

    def __init__(self, rows: int = ROWS, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (rows, 1), generator=g)
        stride = torch.randint(1, 4, (rows, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


EVAL_DATA = ArithmeticSequences(rows=8, seed=2)


def training_arguments(output_dir: str, **overrides: Any) -> Any:
    """Accumulation 2, clipping that bites (max_grad_norm below the norms seen), warm-up then linear decay."""
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-2, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=0.5, lr_scheduler_type="linear",
        warmup_steps=1, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        use_cpu=True, dataloader_num_workers=0, per_device_eval_batch_size=4,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def build_dropout_gpt2(seed: int = 0) -> torch.nn.Module:
    """GPT-2 with dropout everywhere: a resumed run only matches if the RNG is restored too."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1, bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )
    return GPT2LMHeadModel(cfg)


def logged(trainer: Any, key: str = "loss") -> dict[int, float]:
    """{global step: value} of the per-step training logs."""
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h}


def summary(trainer: Any, rank: int = 0) -> dict[str, Any]:
    """Per-step logs, the eval loss after training, and the (gathered) weights on rank 0."""
    eval_loss = trainer.evaluate()["eval_loss"]
    weights = trainer.model.state_dict()  # a collective at stage 3
    return {
        "loss": logged(trainer), "grad_norm": logged(trainer, "grad_norm"),
        "learning_rate": logged(trainer, "learning_rate"), "eval_loss": eval_loss,
        "total_flos": trainer.state.total_flos,
        "weights": {k: v.clone() for k, v in weights.items()} if rank == 0 else None,
    }


def run_plain(arch: str, output_dir: str, trainer_kwargs: dict[str, Any] | None = None, **overrides: Any) -> Any:
    import transformers

    trainer = transformers.Trainer(
        model=build(arch), args=training_arguments(output_dir, **overrides), train_dataset=ArithmeticSequences(),
        eval_dataset=EVAL_DATA, **(trainer_kwargs or {}),
    )
    trainer.train()
    return trainer


def run_zeroinf(
    arch: str, output_dir: str, stage: int, resume_from_checkpoint: str | None = None, offload: Any = None,
    config_fields: dict[str, Any] | None = None, **overrides: Any,
) -> Any:
    """`overrides`: TrainingArguments fields; `config_fields`: more zeroinf.Config fields."""
    import zeroinf
    from zeroinf.integrations import Trainer

    cfg = zeroinf.Config(
        stage=stage, persist_threshold_bytes=0, offload=offload or zeroinf.OffloadConfig(), **(config_fields or {})
    )
    trainer = Trainer(
        model=build(arch), args=training_arguments(output_dir, **overrides), train_dataset=ArithmeticSequences(),
        eval_dataset=EVAL_DATA, zeroinf_config=cfg,
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def train_rank(rank: int, world: int, arch: str, stage: int, root: str) -> dict[str, Any]:
    """One rank of a zeroinf Trainer run at world `world` (per-rank batch 4 // world: the same global
    batches), saving a checkpoint every 2 steps, then the final model to `root/final`."""
    trainer = run_zeroinf(
        arch, os.path.join(root, "run"), stage, per_device_train_batch_size=4 // world, save_strategy="steps",
        save_steps=2,
    )
    trainer.save_model(os.path.join(root, "final"))  # every rank: a gather at stage 3
    return summary(trainer, rank)


def hybrid_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """One rank of a zeroinf Trainer run at world 4 sharded in groups of two (`shard_group_size=2`),
    the same global batches, saving every 2 steps, then the final model to `root/final`; on rank 0
    also the files of the last checkpoint's zeroinf folder."""
    trainer = run_zeroinf(
        "llama", os.path.join(root, "run"), 3, config_fields={"shard_group_size": 2},
        per_device_train_batch_size=4 // world, save_strategy="steps", save_steps=2,
    )
    trainer.save_model(os.path.join(root, "final"))
    out = summary(trainer, rank)
    folder = os.path.join(root, "run", "checkpoint-4", "zeroinf", "step_00000004")
    out["files"] = sorted(os.listdir(folder)) if rank == 0 else None
    return out


NO_CLIP = 1e9  # max_grad_norm that never clips: the norm is logged, the gradients are scaled by exactly 1


def ddp_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """One rank of world-2 runs without clipping, the plain Trainer's (accelerate wraps the model in
    DistributedDataParallel) beside zeroinf's, with accumulation 2 ("plain", stages 0-3, stage 2 with
    the optimizer on the host) and without (per-rank batch 4: "plain-1", "3-1"); summaries on rank 0."""
    import zeroinf

    accumulating = dict(per_device_train_batch_size=4 // world, max_grad_norm=NO_CLIP)
    whole = dict(per_device_train_batch_size=8 // world, gradient_accumulation_steps=1, max_grad_norm=NO_CLIP)
    out = {"plain": summary(run_plain("llama", os.path.join(root, "plain"), **accumulating), rank),
           "plain-1": summary(run_plain("llama", os.path.join(root, "plain-1"), **whole), rank)}
    for stage in (0, 1, 2, 3):
        out[str(stage)] = summary(run_zeroinf("llama", os.path.join(root, str(stage)), stage, **accumulating), rank)
    out["2-host"] = summary(run_zeroinf(
        "llama", os.path.join(root, "2-host"), 2, offload=zeroinf.OffloadConfig(optimizer="host"), **accumulating
    ), rank)
    out["3-1"] = summary(run_zeroinf("llama", os.path.join(root, "3-1"), 3, **whole), rank)
    return out


def each_node_rank(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    """One rank of a world-2 run where each rank is a machine of its own (torchrun's GROUP_RANK)
    with its own disk (`root/machine<rank>`), saving with `save_on_each_node` every 2 steps; or, with
    `resume`, new processes continuing from each machine's own checkpoint-2."""
    os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"] = str(rank), "0"  # torchrun's, on a machine of its own
    out = os.path.join(root, f"machine{rank}", "run")
    trainer = run_zeroinf(
        "llama", out, 3, per_device_train_batch_size=4 // world, save_strategy="steps", save_steps=2,
        save_on_each_node=True, resume_from_checkpoint=os.path.join(out, "checkpoint-2") if resume else None,
    )
    result = summary(trainer, rank)
    result["files"] = {step: sorted(os.listdir(os.path.join(out, f"checkpoint-{step}", "zeroinf", f"step_{step:08d}")))
                       for step in (2, 4)}
    result["weights_files"] = sorted(f for f in os.listdir(os.path.join(out, "checkpoint-4")) if "safetensors" in f)
    return result


def lora_llama() -> torch.nn.Module:
    """The tiny Llama with peft LoRA adapters on q and v (the same adapters after the same seed)."""
    from peft import LoraConfig, get_peft_model

    model = build("llama")
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def adapters_of(trainer: Any) -> dict[str, torch.Tensor]:
    """The trainable (adapter) weights, gathered (a collective at stage 3)."""
    state = trainer.model.state_dict()
    return {n: state[n].clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def run_plain_lora(output_dir: str) -> dict[str, Any]:
    """transformers.Trainer on the LoRA model with activation checkpointing on."""
    import transformers

    args = training_arguments(output_dir, gradient_checkpointing=True)
    trainer = transformers.Trainer(model=lora_llama(), args=args, train_dataset=ArithmeticSequences())
    trainer.train()
    return {"loss": logged(trainer), "grad_norm": logged(trainer, "grad_norm"), "adapters": adapters_of(trainer)}


def lora_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """One rank of a zeroinf Trainer run of the LoRA model at stage 3 (base and adapters sharded), with
    the Trainer's activation checkpointing, a checkpoint every 2 steps, then `save_model`."""
    import zeroinf
    from zeroinf.integrations import Trainer

    args = training_arguments(
        os.path.join(root, "run"), gradient_checkpointing=True, per_device_train_batch_size=4 // world,
        save_strategy="steps", save_steps=2,
    )
    trainer = Trainer(
        model=lora_llama(), args=args, train_dataset=ArithmeticSequences(),
        zeroinf_config=zeroinf.Config(stage=3, persist_threshold_bytes=0),
    )
    trainer.train()
    trainer.save_model(os.path.join(root, "final"))
    engine = zeroinf.engine_of(trainer.model)
    return {
        "loss": logged(trainer), "grad_norm": logged(trainer, "grad_norm"), "adapters": adapters_of(trainer),
        "engine_checkpoints": engine.cfg.activation_checkpointing,
        "model_checkpoints": trainer.model.get_base_model().is_gradient_checkpointing,
    }


class Reversal(torch.utils.data.Dataset):
    """A sequence-to-sequence task for T5: each row's target is the row reversed."""

    def __init__(self, rows: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (rows, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": self.ids[i].flip(0)}


def tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    ))


def seq2seq_run(trainer_class: Any, output_dir: str, **kwargs: Any) -> dict[str, Any]:
    """4 steps, then `predict` with `predict_with_generate`: logged losses, generated tokens, test loss."""
    from transformers import Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=8, per_device_eval_batch_size=4, max_steps=4,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        use_cpu=True, predict_with_generate=True, generation_max_length=10,
    )
    trainer = trainer_class(model=tiny_t5(), args=args, train_dataset=Reversal(32, 1), **kwargs)
    trainer.train()
    predicted = trainer.predict(Reversal(8, 9))
    return {"loss": logged(trainer), "tokens": predicted.predictions.tolist(),
            "test_loss": predicted.metrics["test_loss"]}
