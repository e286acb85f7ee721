"""Tiny supervised fine-tuning runs through `trl.SFTTrainer` and `zeroinf.integrations.SFTTrainer`.

Text rows of a word-level vocabulary ("t5 t6 t7 ..."), tokenized by TRL itself through a tokenizer
built in memory (no download); the tiny Llama of tests/_hf.py. Same seed and data on both sides.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests._hf import VOCAB, build
from tests.integrations._trainer_runs import logged

WORDS = VOCAB - 2  # the last two ids: padding and end of sequence


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(WORDS)} | {"<pad>": WORDS, "<eos>": WORDS + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def text_rows(rows: int = 32, seed: int = 1) -> Any:
    """Arithmetic sequences of 15 words (16 tokens with TRL's end of sequence): learnable in a few steps."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, WORDS, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    ids = ((start + stride * torch.arange(15)) % WORDS).tolist()
    return Dataset.from_dict({"text": [" ".join(f"t{i}" for i in row) for row in ids]})


def sft_config(output_dir: str, **overrides: Any) -> Any:
    from trl import SFTConfig

    kwargs: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, use_cpu=True, bf16=False,
    )
    kwargs.update(overrides)
    return SFTConfig(**kwargs)


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def trained(trainer: Any) -> dict[str, Any]:
    """Logged losses and grad norms, and the trainable weights gathered (a collective at stage 3)."""
    trainer.train()
    state = trainer.model.state_dict()
    trainable = {n: state[n].clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"loss": logged(trainer), "grad_norm": logged(trainer, "grad_norm"), "trainable": trainable}


def run_plain(output_dir: str, peft: bool, **overrides: Any) -> dict[str, Any]:
    from trl import SFTTrainer

    torch.manual_seed(0)
    trainer = SFTTrainer(model=build("llama"), args=sft_config(output_dir, **overrides), train_dataset=text_rows(),
                         processing_class=tokenizer(), peft_config=lora() if peft else None)
    return trained(trainer)


def zeroinf_trainer(output_dir: str, peft: bool, stage: int, **overrides: Any) -> Any:
    import zeroinf
    from zeroinf.integrations import SFTTrainer

    torch.manual_seed(0)
    return SFTTrainer(model=build("llama"), args=sft_config(output_dir, **overrides), train_dataset=text_rows(),
                      processing_class=tokenizer(), peft_config=lora() if peft else None,
                      # the LM head a unit of its own, gathered only while used (split_root): TRL's fused
                      # LM head reads lm_head.weight without calling the module
                      zeroinf_config=zeroinf.Config(stage=stage, persist_threshold_bytes=0, split_root_min_bytes=0))


def sft_rank(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    """One rank of the full and the LoRA fine-tune at stage 3 (per-rank batch 4 // world: the same
    global batches); the LoRA run then writes its adapters with `save_model`."""
    torch.set_num_threads(1)
    out = {}
    for peft in (False, True):
        name = "lora" if peft else "full"
        trainer = zeroinf_trainer(os.path.join(root, name), peft, 3, per_device_train_batch_size=4 // world)
        out[name] = trained(trainer)
        if peft:
            trainer.save_model(os.path.join(root, "adapters"))  # every rank: a collective
    return out


def preference_rows(rows: int = 32, seed: int = 1) -> Any:
    """Prompt, chosen (the sequence goes on by its stride) and rejected (by twice it) continuations."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, WORDS, (rows, 1), generator=g)
    good = ((start + torch.arange(12)) % WORDS).tolist()
    bad = ((start + 2 * torch.arange(12)) % WORDS).tolist()

    def words(row: list[int]) -> str:
        return " ".join(f"t{i}" for i in row)

    return Dataset.from_dict({"prompt": [words(r[:6]) for r in good], "chosen": [" " + words(r[6:]) for r in good],
                              "rejected": [" " + words(r[6:]) for r in bad]})


def dpo_run(
    trainer_class: Any, output_dir: str, peft: bool, ref_model: Any = None, model: Any = None, **kwargs: Any
) -> dict[str, Any]:
    """4 DPO steps: the full model against `ref_model`, or LoRA against its base (adapters disabled);
    `model` (default: the tiny Llama) may be a folder, whose model is then the reference too."""
    from trl import DPOConfig

    args = DPOConfig(
        output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, use_cpu=True, bf16=False,
    )
    torch.manual_seed(0)
    trainer = trainer_class(model=build("llama") if model is None else model, ref_model=ref_model, args=args,
                            train_dataset=preference_rows(), processing_class=tokenizer(),
                            peft_config=lora() if peft else None, **kwargs)
    return trained(trainer) | {"trainer": trainer}


def odd_words(completions: list[str], **_: Any) -> list[float]:
    """A GRPO reward: the share of odd-numbered words in a completion (varies between samples)."""
    return [sum(int(w[1:]) % 2 for w in c.split() if w[1:].isdigit()) / max(1, len(c.split())) for c in completions]


def grpo_run(trainer_class: Any, output_dir: str, **kwargs: Any) -> dict[str, Any]:
    """3 GRPO steps: 4 prompts x 4 sampled completions of 6 tokens, rewarded by `odd_words`."""
    from datasets import Dataset
    from trl import GRPOConfig

    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, WORDS, (16, 1), generator=g)
    prompts = [" ".join(f"t{i}" for i in row) for row in ((start + torch.arange(5)) % WORDS).tolist()]
    args = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=3, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=0, use_cpu=True, bf16=False,
    )
    torch.manual_seed(0)
    trainer = trainer_class(model=build("llama"), reward_funcs=odd_words, args=args,
                            train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer(),
                            **kwargs)
    out = trained(trainer)
    out["reward"] = logged(trainer, "reward")
    return out
