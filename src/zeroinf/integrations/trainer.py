"""`zeroinf.integrations.Trainer`: `transformers.Trainer` training a zeroinf-sharded model.

    trainer = Trainer(model=model, args=TrainingArguments(...), zeroinf_config=zeroinf.Config(stage=3),
                      train_dataset=ds)
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)
    trainer.save_model("out")            # a Hugging Face folder: AutoModelForCausalLM.from_pretrained("out")

What differs from the plain Trainer, and where it happens:
- Model: sharded by `zeroinf.shard` at the end of the constructor (or in `call_model_init`) and marked
  as prepared for accelerate, which then neither wraps it in DDP, nor moves it, nor adds autocast:
  zeroinf places the parameters and reduces the gradients itself ([Note: accelerate and the sharded
  model], [Note: sharding after the Trainer's constructor]).
- Compute dtype: `bf16=True` / `fp16=True` become `Config.param_dtype` (trainer_args.py).
- Optimizer: `zeroinf.AdamW` with the Trainer's param groups (weight decay except biases and norms)
  and its lr, betas, eps; for another `optim` (sgd, adagrad, rmsprop), the torch optimizer the plain
  Trainer picks, over the same groups, through `zeroinf.ShardedOptimizer`. The Trainer's LR
  scheduler runs on it unchanged.
- Accumulation and clipping: `gradient_accumulation_steps` and `max_grad_norm` go into the Config
  (trainer_args.py). The Trainer does not clip; the engine does, exactly across shards, and its
  norm is logged as `grad_norm` every step, as the plain Trainer logs it (`AdamW(track_grad_norm=True)`).
- fp16 (`Config(param_dtype="fp16")`): gradients carry the optimizer's loss scale (`compute_loss`);
  an overflowing step is skipped and the LR scheduler does not advance.
- Checkpoints (`save_steps`): `checkpoint-N/zeroinf/` holds the sharded states (`zeroinf.save`), and
  `checkpoint-N/` the weights consolidated from them (streamed on rank 0, no gather) with the config,
  so `from_pretrained(checkpoint-N)` works; scheduler, RNG and trainer state are the Trainer's own
  files. `resume_from_checkpoint` loads the sharded states (`zeroinf.load`) at any world size, stage
  or placement; the Trainer restores RNG and data position as usual.
- `save_model`: `zeroinf.save_pretrained` on every rank (one unit gathered at a time, rank 0 writes);
  a peft model's adapters only, as the plain Trainer writes them.
- Parameter counts (`floating_point_ops`, the "Number of trainable parameters" log): each parameter at
  its full size (`ds_numel`), where the plain Trainer reads that only under DeepSpeed and logged 0
  trainable parameters of a stage-3 model, whose parameters are empty placeholders between passes.
- `torch_compile=True`: the loss is computed through `torch.compile` of the sharded model
  (`torch_compile_backend`, `torch_compile_mode`), docs/design.md "torch.compile".

[Note: accelerate and the sharded model]
`Accelerator.prepare_model` / `prepare_optimizer` return an object unchanged when it carries
accelerate's own `_is_accelerate_prepared` flag (its guard against double wrapping). `zeroinf.shard`
sets it on the sharded model and `zeroinf.AdamW` on itself, so this holds in a user's own
`accelerator.prepare(model, opt, loader)` loop too: DDP on top of zeroinf would reduce every
gradient twice (and cannot handle stage-3 placeholders), a device move would break the parameters'
views into flat buffers (the next forward stopped with the engine's "converted after zeroinf.shard"
error), and `AcceleratedOptimizer` would round-trip the whole optimizer state through
`state_dict()` at construction. Accelerate's autocast is skipped with the rest: `Config.param_dtype`
sets the compute dtype. The Trainer methods overridden below are the ones the Trainer runs
for DeepSpeed and FSDP in the same places; `_REQUIRED_HOOKS` checks they exist in the installed
transformers, so an incompatible version fails at import, by name, not mid-training.

[Note: sharding after the Trainer's constructor]
Trainers built on this one (`SFTTrainer(Trainer, trl.SFTTrainer)`, `Seq2SeqTrainer`) change the model
in their constructors before handing it to `transformers.Trainer`'s: TRL's `peft_config=` wraps it in
peft adapters, its fused LM head patches `forward`. Sharded first, the adapters would be parameters no
unit holds (AdamW refused "21 trainable parameters are in no param group"). So the model is sharded
when the whole constructor chain has run, in place (`shard` returns the module it was given, so every
reference the Trainer and its callbacks hold stays valid); nothing in between moves it to the device
(`_move_model_to_device`). A model the caller sharded already cannot take adapters: a constructor that
wrapped it anyway is refused, naming the two ways that work.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import transformers
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import TrainerCallback

import zeroinf
from zeroinf.config import Config
from zeroinf.engine import engine_of, sharded_engine
from zeroinf.integrations.peft_layers import is_peft_model
from zeroinf.integrations.trainer_args import (
    ADAMW_OPTIMS,
    LION_OPTIMS,
    TrainerArgumentsError,
    asked_dtype,
    asks_checkpointing,
    config_for_trainer,
)
from zeroinf.optim.adamw import AdamW
from zeroinf.optim.lion import Lion
from zeroinf.optim.sharded import ShardedOptimizerBase
from zeroinf.optim.torch_optimizer import ShardedOptimizer
from zeroinf.partition.unit import full_numel

ZEROINF_DIR = "zeroinf"
"""Sub-folder of a Trainer checkpoint holding the sharded zeroinf checkpoint."""

_REQUIRED_HOOKS = (
    "_move_model_to_device", "_clip_grad_norm", "_get_grad_norm", "_save_checkpoint",
    "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
    "set_initial_training_values", "create_optimizer", "compute_loss", "call_model_init", "save_model", "_save",
    "_load_best_model",
)
_missing = [h for h in _REQUIRED_HOOKS if not hasattr(transformers.Trainer, h)]
if _missing:
    raise ImportError(
        f"zeroinf.integrations.Trainer needs transformers.Trainer methods {_missing}, absent from transformers "
        f"{transformers.__version__}; it is tested with transformers 5.x: pip install -U 'transformers>=5'"
    )


@contextlib.contextmanager
def _full_size_parameter_count() -> Iterator[None]:
    """While training, the Trainer's "Number of trainable parameters" log counts full sizes: it reads
    `ds_numel` only when DeepSpeed's ZeRO-3 is on, so it logged 0 for a stage-3 model. The count is a
    module-level function of transformers.trainer, replaced for the duration and put back."""
    import transformers.trainer as hf_trainer

    counted = getattr(hf_trainer, "get_model_param_count", None)
    if counted is None:  # another transformers: nothing to correct
        yield
        return

    def full_size(model: nn.Module, trainable_only: bool = False) -> int:
        return sum(full_numel(p) for p in model.parameters() if p.requires_grad or not trainable_only)

    hf_trainer.get_model_param_count = full_size
    try:
        yield
    finally:
        hf_trainer.get_model_param_count = counted


def _is_sharded(model: nn.Module) -> bool:
    return sharded_engine(model) is not None


def _args_for_the_sharded_model(args: transformers.TrainingArguments) -> transformers.TrainingArguments:
    """`args` as the Trainer must see them once the engine has taken the compute dtype and activation
    checkpointing (trainer_args.py): without accelerate's autocast and GradScaler (the parameters take
    the dtype) and without the model's own checkpointing (the engine recomputes its units). A copy:
    the caller's arguments are left as they were."""
    dtype_flags = asked_dtype(args) is not None
    if not (dtype_flags or asks_checkpointing(args)):
        return args
    args = copy.copy(args)
    if asks_checkpointing(args):
        args.gradient_checkpointing = False
        if hasattr(args, "activation_checkpointing"):  # the newer name (after transformers 5.17)
            setattr(args, "activation_checkpointing", False)  # noqa: B010 (not in 5.17's stubs)
    if dtype_flags:
        args.fp16 = args.bf16 = False
        args.mixed_precision = "no"
    return args


class _ScaleGradient(torch.autograd.Function):
    """Identity on the value; multiplies the gradient by `scale`: the backward of `loss * scale`."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _ZeroGradAfterStep(TrainerCallback):
    """The Trainer only calls `model.zero_grad()`; zeroinf's gradient shards are cleared by the optimizer."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kwargs["optimizer"].zero_grad()


class Trainer(transformers.Trainer):
    """`transformers.Trainer` on a model sharded by zeroinf (see the module docstring).

    `zeroinf_config`: how to shard (stage, dtype, offload...); default `Config()`. Its accumulation
    and clipping come from `args`. `checkpoint_weights=False` leaves the consolidated weights out of
    `checkpoint-N/` (the sharded states suffice to resume; `zeroinf consolidate` writes them later).
    Every other argument is `transformers.Trainer`'s.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *trainer_args: Any,
        zeroinf_config: Config | Mapping[str, Any] | None = None,
        checkpoint_weights: bool = True,
        **trainer_kwargs: Any,
    ) -> None:
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        presharded = False
        if model is not None and _is_sharded(model):
            presharded = True
            if zeroinf_config is not None:
                raise ValueError(
                    "zeroinf.integrations.Trainer: the model is already sharded and keeps its own Config; "
                    "leave zeroinf_config out (or pass the unsharded model)"
                )
            zeroinf_config = engine_of(model).cfg
        self.zeroinf_config = config_for_trainer(Config.of(zeroinf_config, "zeroinf.integrations.Trainer"), args)
        args = _args_for_the_sharded_model(args)
        args.device  # noqa: B018 - accelerate joins the process group (torchrun) before we shard across it
        self.checkpoint_weights = checkpoint_weights
        self._saving_checkpoint = False
        if trainer_args:  # transformers.Trainer's positional order
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
        else:  # by name: subclasses' constructors order theirs otherwise (TRL's DPOTrainer: model, ref_model, args)
            super().__init__(model=model, args=args, **trainer_kwargs)
        if self.model is not None:  # [Note: sharding after the Trainer's constructor]
            if presharded and self.model is not model:  # (a PeftModel forwards attribute reads: identity tells)
                raise TrainerArgumentsError(
                    f"{type(self).__name__} wrapped the model after it was sharded (peft_config= applies peft "
                    "adapters, which the sharded model cannot take): pass the model unsharded (built plainly or "
                    "under `with zeroinf.init():`), and the Trainer shards it after the adapters are added; or add "
                    "them yourself before sharding (zeroinf.from_pretrained(..., prepare=lambda m: "
                    "get_peft_model(m, lora))) and leave peft_config unset"
                )
            self._shard(self.model)  # in place: every reference the Trainer holds stays valid
        if self.optimizer is not None:
            self._check_optimizer(self.optimizer)
        if self.optimizer_cls_and_kwargs is not None:
            raise TrainerArgumentsError(
                "zeroinf.integrations.Trainer trains with zeroinf.AdamW: leave optimizer_cls_and_kwargs unset"
            )
        if self.args.n_gpu > 1:
            self.args._n_gpu = 1  # one device per process (no nn.DataParallel): launch with torchrun for more
        self.add_callback(_ZeroGradAfterStep)

    # -- the model and the optimizer --------------------------------------------------------------------
    def _shard(self, model: nn.Module) -> nn.Module:
        if _is_sharded(model):
            cfg, wanted = engine_of(model).cfg, self.zeroinf_config
            differ = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(wanted, f.name)]
            if differ:
                got = ", ".join(f"{n}={getattr(cfg, n)!r}" for n in differ)
                want = ", ".join(f"{n}={getattr(wanted, n)!r}" for n in differ)
                raise TrainerArgumentsError(
                    f"the model was sharded with {got}, but this Trainer needs {want} (accumulation, clipping and "
                    "activation checkpointing come from TrainingArguments): make them agree, or pass the unsharded "
                    "model"
                )
        else:
            model = zeroinf.shard(model, self.zeroinf_config)
        return model

    def _sharded_model(self) -> nn.Module:
        assert self.model is not None and _is_sharded(self.model), "zeroinf.integrations.Trainer has no sharded model"
        return self.model

    def call_model_init(self, trial: Any = None) -> nn.Module:
        return self._shard(super().call_model_init(trial))

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: `zeroinf.shard` places each unit on its tier and device (the plain Trainer would move
        the whole unsharded model to the device first, which is what offloading avoids)."""

    def _check_optimizer(self, optimizer: Any) -> None:
        if not isinstance(optimizer, ShardedOptimizerBase) or optimizer.engine is not engine_of(self._sharded_model()):
            raise TrainerArgumentsError(
                f"optimizers=({type(optimizer).__name__}, ...): pass a zeroinf.AdamW (or zeroinf.ShardedOptimizer) "
                "built on this Trainer's model (zeroinf.AdamW(trainer_model, ...)), or leave optimizers unset to "
                "get one from TrainingArguments"
            )

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """zeroinf.AdamW with the plain Trainer's param groups and hyperparameters; for another `optim`
        (sgd, adagrad, rmsprop, ...), the torch optimizer the plain Trainer picks, sharded by
        zeroinf.ShardedOptimizer (which refuses one it cannot compute over shards, such as adafactor);
        for bitsandbytes' 32-bit Lion (`lion_32bit`), zeroinf.Lion, the same update, sharded likewise."""
        if self.optimizer is None:
            model = self._sharded_model()
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            optim = str(getattr(self.args.optim, "value", self.args.optim))  # a str enum
            if optim not in ADAMW_OPTIMS:
                if optim in LION_OPTIMS:  # bitsandbytes' 32-bit Lion: the same update, zeroinf.Lion over the shards
                    cls: Any = Lion
                    settings = {"lr": self.args.learning_rate, "betas": (self.args.adam_beta1, self.args.adam_beta2)}
                else:
                    cls, settings = self.get_optimizer_cls_and_kwargs(self.args, cast(Any, model))
                self.optimizer = ShardedOptimizer(cls, groups, track_grad_norm=True, **settings)
                self._check_optimizer(self.optimizer)
                return self.optimizer
            self.optimizer = AdamW(
                model,
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                weight_decay=self.args.weight_decay,
                param_groups=groups,
                track_grad_norm=True,  # the Trainer logs grad_norm every step, clipping or not
            )
            self._check_optimizer(self.optimizer)
        return self.optimizer

    # -- one step ------------------------------------------------------------------------------------------
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if self.args.torch_compile:
            model = self._compiled(model)
        out = super().compute_loss(model, inputs, *args, **kwargs)
        scale = self.optimizer.loss_scale if isinstance(self.optimizer, ShardedOptimizerBase) else 1.0
        if isinstance(self.optimizer, ShardedOptimizerBase) and torch.is_grad_enabled():
            self.optimizer.engine.loss_scaled = True  # the backward of this loss carries the scale
        if scale == 1.0 or not torch.is_grad_enabled():
            return out
        # fp16: backward of `loss * scale` (what opt.backward does) while the logged value stays the loss
        if isinstance(out, tuple):
            return (_ScaleGradient.apply(out[0], scale), *out[1:])
        return _ScaleGradient.apply(out, scale)

    def _compiled(self, model: nn.Module) -> nn.Module:
        """`torch_compile=True`: the sharded model through `torch.compile` (accelerate, which compiles
        for the plain Trainer, leaves a prepared model alone). Built once per model."""
        cached = getattr(self, "_compiled_model", None)
        if cached is None or cached[0] is not model:
            backend = self.args.torch_compile_backend or "inductor"
            compiled = torch.compile(model, backend=backend, mode=self.args.torch_compile_mode)
            cached = (model, cast(nn.Module, compiled))  # an OptimizedModule
            self._compiled_model = cached
        return cached[1]

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the engine clips in optimizer.step() (Config.grad_clip_norm = max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # parameters hold no gradients here; `log` reports the engine's norm

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The plain Trainer's 6 x tokens x non-embedding parameters, with each parameter counted at its
        full size (zeroinf.shard gives the model a `num_parameters` that counts them so: between passes a
        stage-3 parameter is an empty placeholder)."""
        model = self._sharded_model()
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(model, "num_parameters"):
            return 0
        return 6 * inputs[main_input].numel() * int(cast(Any, model).num_parameters(exclude_embeddings=True))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with _full_size_parameter_count():
            return super().train(*args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        norm = getattr(self.optimizer, "last_grad_norm", None)
        if "loss" in logs and norm is not None:
            logs.setdefault("grad_norm", norm)
        super().log(logs, *args, **kwargs)

    def set_initial_training_values(self, args: transformers.TrainingArguments, dataloader: Any) -> tuple:
        values = super().set_initial_training_values(args, dataloader)
        steps_in_epoch, max_steps = int(values[5] or 0), int(values[6])
        accum = args.gradient_accumulation_steps
        if steps_in_epoch % accum and max_steps > steps_in_epoch // accum:
            raise TrainerArgumentsError(
                f"an epoch has {steps_in_epoch} batches per rank, not a multiple of gradient_accumulation_steps="
                f"{accum}: its last optimizer step would follow {steps_in_epoch % accum} backward passes, and zeroinf "
                f"steps after exactly {accum}. Make the batches per epoch a multiple of {accum} (dataset size, "
                f"batch size, dataloader_drop_last) or set max_steps <= {steps_in_epoch // accum}"
            )
        return values

    # -- saving ----------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder (weights, config, tokenizer), or a peft model's adapter folder; every
        rank must call it (`zeroinf.save_pretrained`: one unit gathered at a time, rank 0 writes)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._saving_checkpoint and not self.args.save_only_model and self.optimizer is not None:
            return  # a checkpoint's weights are written with its sharded states (_save_optimizer_and_scheduler)
        assert output_dir is not None, "TrainingArguments always has an output_dir"
        zeroinf.save_pretrained(self._sharded_model(), output_dir, on_each_node=self.args.save_on_each_node)
        if self.args.should_save:
            self._save_model_files(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        sharded = os.path.join(output_dir, ZEROINF_DIR)
        model = self._sharded_model()
        # `save_on_each_node`: every machine keeps the checkpoint on its own disk (each its ranks' states,
        # checkpoint/saving.py [Note: node-local checkpoints]); the weights are then written by each
        # machine's first rank from the gathered model, since no machine holds every rank's states
        each_node = self.args.save_on_each_node
        zeroinf.save(sharded, model, self.optimizer, step=self.state.global_step, node_local=each_node)  # collective
        adapters = is_peft_model(model)  # the plain Trainer's checkpoints: adapters
        if self.checkpoint_weights and (adapters or each_node):  # a collective
            zeroinf.save_pretrained(model, output_dir, on_each_node=each_node)
        if not self.args.should_save:
            return
        if self.checkpoint_weights:
            if not adapters and not each_node:  # streamed from the sharded states on rank 0, nothing gathered
                # frozen parameters sharded at stage 3 are not in the checkpoint: written without, warned
                zeroinf.consolidate(sharded, output_dir, dtype=self.zeroinf_config.param_dtype, allow_missing=True)
            self._save_model_files(output_dir)
        if self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save_model_files(self, output_dir: str) -> None:
        """What `Trainer._save` adds beside a model's folder (its config files come with the weights:
        `zeroinf.save_pretrained`, `zeroinf.consolidate`)."""
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    # -- resuming --------------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Weights and optimizer states load together once the optimizer exists (_load_optimizer_and_scheduler).
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZEROINF_DIR)) and not _plain_checkpoint(
            resume_from_checkpoint
        ):
            raise ValueError(
                f"{resume_from_checkpoint} has no {ZEROINF_DIR}/ folder: zeroinf resumes from the sharded checkpoints "
                f"it writes, or from a plain Trainer's ({SAFE_WEIGHTS_NAME} and {OPTIMIZER_NAME}); a checkpoint "
                "saved with save_only_model=True cannot be resumed: load such weights with from_pretrained before "
                "building this Trainer"
            )

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's weights and optimizer states from its sharded
        folder (`zeroinf.load`, a collective), as the Trainer loads a DeepSpeed checkpoint whole."""
        best = self.state.best_model_checkpoint
        assert best is not None, "the Trainer loads the best model only once it has one"
        zeroinf.load(os.path.join(best, ZEROINF_DIR), self._sharded_model(), self.optimizer, load_rng=False)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        # RNG: the Trainer restores its own files once it has skipped the trained batches.
        if os.path.isdir(os.path.join(checkpoint, ZEROINF_DIR)):
            zeroinf.load(os.path.join(checkpoint, ZEROINF_DIR), self._sharded_model(), self.optimizer, load_rng=False)
        else:  # [Note: resuming a plain Trainer's checkpoint]
            zeroinf.load_weights(self._sharded_model(), os.path.join(checkpoint, SAFE_WEIGHTS_NAME))
            state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
            zeroinf.load_full_optimizer_state_dict(cast(ShardedOptimizerBase, self.optimizer), state)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _plain_checkpoint(folder: str) -> bool:
    """Whether `folder` is a checkpoint of the plain Trainer with one safetensors file and its optimizer.

    [Note: resuming a plain Trainer's checkpoint]
    A fine-tune started with `transformers.Trainer` that outgrows the GPU continues here: its
    `checkpoint-N/` holds the weights (`model.safetensors`) and the optimizer in torch.optim's format
    (`optimizer.pt`), which `zeroinf.load_weights` and `zeroinf.load_full_optimizer_state_dict`
    (optim/torch_format.py) load at any world size, stage and placement; the scheduler, the trainer
    state and the RNG files are the Trainer's own. Both Trainers build the same param groups (decay and
    no-decay, `get_decay_parameter_names`), so the optimizer's indices line up; a mismatch is refused
    naming the group sizes. The continued steps equal the plain run's within the parity tolerances
    (tests/integrations/test_trainer.py)."""
    return all(os.path.isfile(os.path.join(folder, name)) for name in (SAFE_WEIGHTS_NAME, OPTIMIZER_NAME))


class Seq2SeqTrainer(Trainer, transformers.Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` on a sharded model: `predict_with_generate` and its generation
    arguments, with everything `Trainer` (above) changes. Takes `Seq2SeqTrainingArguments`."""
