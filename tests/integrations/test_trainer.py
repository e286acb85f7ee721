"""`zeroinf.integrations.Trainer` against plain `transformers.Trainer` (tests/integrations/_trainer_runs.py).

- Parity, fp32, world 1: stages 0-3 log the plain Trainer's losses, grad norms and learning rates and
  end with its weights. Tolerance: tests/test_parity.py's fp32 one (rtol 1e-5, atol 5e-5); the
  clipping coefficient is computed in another order than torch's clip_grad_norm_, so clipped steps
  may differ in the last bits (measured: 1e-7 relative on losses).
- Parity, world 2 (spawned gloo ranks, per-rank batch 2): the same global batches, the same losses;
  without clipping, bitwise the plain Trainer at world 2 (DDP) at stages 0-2, and at stage 3 without
  accumulation.
- Resume: 6 steps with a checkpoint at step 3, then a new Trainer (other initial weights) resumes
  from it: steps 4-6 log bitwise the losses of the uninterrupted run and end with bitwise its weights,
  with dropout on (RNG) and a shuffled sampler (data position), also into another stage.
- `model_init` trials (hyperparameter search's pattern): each `train()` builds a model, trains as the
  plain one, and the previous model's engine, threads and swap files are released.
- `auto_find_batch_size` with an out-of-memory error simulated in backward for batches above 2 rows:
  the retried run logs the plain Trainer's losses and ends with its weights (device and NVMe).
- Saved folders load with `from_pretrained`: `save_model` (gathered) and every checkpoint (consolidated).
- fp16: gradients carry the loss scale; overflowing steps are skipped and the LR schedule waits.
- `Seq2SeqTrainer` (T5, `predict_with_generate`), stage 3 in one process: the plain one's losses and
  generated tokens (its `generate` was told `synced_gpus=True` for a stage-3 model and stopped on the
  missing process group).
- A peft LoRA model with `gradient_checkpointing=True`, world 2, stage 3: the plain Trainer's losses
  and adapters; the engine checkpoints (not the model too); checkpoints and `save_model` hold what the
  plain Trainer writes for it, the adapters (they used to be the whole model under peft's names,
  which neither peft nor transformers loads), and a checkpoint resumes.

Every single-process run uses one CPU thread: on two shared cores, thread contention makes a
4-step run of this tiny model take seconds instead of a fraction of one.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zeroinf  # noqa: E402
from tests._harness import run_ranks  # noqa: E402
from tests._parity import bitwise_equal  # noqa: E402
from tests.integrations._trainer_runs import (  # noqa: E402
    EVAL_DATA,
    ArithmeticSequences,
    build_dropout_gpt2,
    each_node_rank,
    logged,
    lora_llama,
    lora_rank,
    run_plain,
    run_plain_lora,
    run_zeroinf,
    seq2seq_run,
    summary,
    train_rank,
    training_arguments,
)
from tests.integrations.conftest import single_thread  # noqa: E402
from zeroinf.integrations import Seq2SeqTrainer, Trainer, TrainerArgumentsError  # noqa: E402

RTOL, ATOL = 1e-5, 5e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integrations/conftest.py


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory: pytest.TempPathFactory) -> dict:
    with single_thread():  # module-scoped: runs before the function-scoped `one_thread`
        return summary(run_plain("llama", str(tmp_path_factory.mktemp("plain"))))


def _assert_parity(ours: dict, plain: dict, where: str) -> None:
    assert sorted(ours["loss"]) == [1, 2, 3, 4], where
    assert plain["loss"][4] < plain["loss"][1] - 0.1, "the reference run must learn something"
    for key in ("loss", "grad_norm"):
        for step, ref in plain[key].items():
            assert ours[key][step] == pytest.approx(ref, rel=RTOL), f"{where}: step {step} {key}"
    assert ours["learning_rate"] == plain["learning_rate"], where
    assert ours["eval_loss"] == pytest.approx(plain["eval_loss"], rel=RTOL), where
    assert ours["total_flos"] == plain["total_flos"], where  # counted unsharded (stage 3: placeholders)
    for name, ref in plain["weights"].items():
        torch.testing.assert_close(
            ours["weights"][name], ref, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{where}: {name}: {m}"
        )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_plain_trainer(tmp_path, plain_llama, stage: int) -> None:
    trainer = run_zeroinf("llama", str(tmp_path), stage)
    _assert_parity(summary(trainer), plain_llama, f"stage {stage}")
    assert isinstance(trainer.optimizer, zeroinf.AdamW)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]  # norms: no decay
    assert trainer.model is trainer.model_wrapped  # no DDP or other wrapper


def test_grad_norm_is_logged_without_clipping_too(tmp_path) -> None:
    """max_grad_norm=0: the plain Trainer still logs each step's gradient norm; so does ours (the step
    runs inside backward there, and the norm comes from squares kept as units are stepped)."""
    plain = summary(run_plain("llama", str(tmp_path / "plain"), max_grad_norm=0.0))
    ours = summary(run_zeroinf("llama", str(tmp_path / "ours"), 3, max_grad_norm=0.0))
    assert sorted(plain["grad_norm"]) == [1, 2, 3, 4]
    for step, ref in plain["grad_norm"].items():
        assert ours["grad_norm"][step] == pytest.approx(ref, rel=RTOL), f"step {step}"
    for name, ref in plain["weights"].items():
        torch.testing.assert_close(ours["weights"][name], ref, rtol=RTOL, atol=ATOL)


def test_the_logged_parameter_count_is_the_full_size(tmp_path) -> None:
    """Stage 3: the Trainer's "Number of trainable parameters" log counts each parameter at its full
    size (between passes a parameter is an empty placeholder; the plain Trainer logged 0), and the
    Trainer's own counting function is put back after training."""
    import logging

    import transformers.trainer as hf_trainer

    from tests._hf import build

    full = sum(p.numel() for p in build("llama").parameters())
    counted = hf_trainer.get_model_param_count
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    trainer_logger = logging.getLogger("transformers.trainer")
    level = trainer_logger.level
    trainer_logger.addHandler(handler)
    trainer_logger.setLevel(logging.INFO)
    try:
        trainer = run_zeroinf("llama", str(tmp_path), 3, max_steps=2)
    finally:
        trainer_logger.removeHandler(handler)
        trainer_logger.setLevel(level)
    logged_counts = [r for r in records if "Number of trainable parameters" in r]
    assert logged_counts == [f"  Number of trainable parameters = {full:,}"], logged_counts
    assert hf_trainer.get_model_param_count is counted
    assert counted(trainer.model) < full  # what the plain count sees between passes: placeholders


def test_offloaded_to_nvme_matches_plain_trainer(tmp_path, plain_llama) -> None:
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", gradients="nvme", nvme_dir=str(tmp_path / "swap"))
    os.makedirs(tmp_path / "swap")
    trainer = run_zeroinf("llama", str(tmp_path / "run"), 3, offload=offload)
    _assert_parity(summary(trainer), plain_llama, "stage 3, everything on NVMe")


def test_torch_compile_matches_plain_trainer(tmp_path, plain_llama) -> None:
    """`torch_compile=True`: the loss goes through torch.compile of the sharded model (aot_eager: the
    compiler's tracing and autograd without fused kernels), same losses and weights."""
    trainer = run_zeroinf("llama", str(tmp_path), 3, torch_compile=True, torch_compile_backend="aot_eager")
    _assert_parity(summary(trainer), plain_llama, "stage 3, torch_compile")
    compiled = trainer._compiled_model
    assert compiled[0] is trainer.model and compiled[1]._orig_mod is trainer.model


def test_model_init_and_a_presharded_model_with_its_optimizer(tmp_path, plain_llama) -> None:
    from tests._hf import build

    args = training_arguments(str(tmp_path))
    by_init = Trainer(
        model_init=lambda: build("llama"), args=args, train_dataset=ArithmeticSequences(), eval_dataset=EVAL_DATA,
        zeroinf_config=zeroinf.Config(stage=3, persist_threshold_bytes=0),
    )
    by_init.train()
    _assert_parity(summary(by_init), plain_llama, "model_init")

    model = zeroinf.shard(build("llama"), zeroinf.Config(stage=3, grad_accum_steps=2, grad_clip_norm=0.5))
    opt = zeroinf.AdamW(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)  # one group: norms decay too
    mine = Trainer(model=model, args=args, train_dataset=ArithmeticSequences(), optimizers=(opt, None))
    mine.train()
    assert mine.optimizer is opt and opt.step_count == 4
    needs = r"grad_accum_steps=1, grad_clip_norm=None, but this Trainer needs grad_accum_steps=2, grad_clip_norm=0.5"
    with pytest.raises(TrainerArgumentsError, match=needs):
        Trainer(model=zeroinf.shard(build("llama"), zeroinf.Config()), args=args)


def test_each_model_init_trial_releases_the_previous_model(tmp_path, plain_llama) -> None:
    """`model_init` builds a model per `train()` (what `hyperparameter_search` does per trial): the
    previous model's engine, threads and swap files go with it (runtime/hooks.py [Note: hooks that hold
    the engine weakly]; every trial's used to stay until exit), and each trial trains as the plain one."""
    import gc
    import threading
    import weakref

    from tests._hf import build

    swap = tmp_path / "swap"
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0, offload={"params": "nvme", "optimizer": "nvme", "nvme_dir": str(swap)}
    )
    trainer = Trainer(
        model_init=lambda: build("llama"), args=training_arguments(str(tmp_path / "out")),
        train_dataset=ArithmeticSequences(), eval_dataset=EVAL_DATA, zeroinf_config=cfg,
    )
    engines, seen = [], []
    gc.collect()  # an earlier test's garbage goes first, so that the counts below are this test's
    for _ in range(3):
        trainer.train()
        _assert_parity(summary(trainer), plain_llama, "model_init trial")
        engines.append(weakref.ref(zeroinf.engine_of(trainer.model)))
        gc.collect()
        threads = sum(t.name.startswith("zeroinf") for t in threading.enumerate())
        seen.append((sum(e() is not None for e in engines), len(list(swap.iterdir())), threads))
    assert [alive for alive, _, _ in seen] == [1, 1, 1], seen
    assert len({(files, threads) for _, files, threads in seen}) == 1, seen  # nothing piles up


class _OutOfMemory(torch.autograd.Function):
    """Identity forward; its backward raises what accelerate's find_executable_batch_size takes for an
    out-of-memory error."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def _llama_out_of_memory_above(rows: int) -> torch.nn.Module:
    """The tiny Llama whose backward runs out of memory for batches above `rows`, at the first
    decoder layer's output: after the later units' gradients (stepped inside backward on NVMe)."""
    from tests._hf import build

    model = build("llama")

    def hook(module: torch.nn.Module, args: object, out: object) -> object:
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.shape[0] <= rows:
            return None
        hidden = _OutOfMemory.apply(hidden)
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    model.model.layers[0].register_forward_hook(hook)
    return model


@pytest.mark.parametrize("placement", ["device", "nvme"])
def test_auto_find_batch_size_retries_as_the_plain_trainer(tmp_path, placement: str) -> None:
    """integrations/trainer_args.py [Note: auto_find_batch_size]: batches of 8 and 4 rows run out of
    memory in backward, 2 fit; the run that follows logs the plain Trainer's losses and ends with its
    weights (clipping on, the Trainer's default kind: the step begun in the failed backward is undone)."""
    import transformers

    def args(name: str):  # type: ignore[no-untyped-def]
        return training_arguments(
            str(tmp_path / name), per_device_train_batch_size=8, auto_find_batch_size=True,
            gradient_accumulation_steps=1,
        )

    plain = transformers.Trainer(
        model=_llama_out_of_memory_above(2), args=args("plain"), train_dataset=ArithmeticSequences()
    )
    plain.train()
    offload = {} if placement == "device" else {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path / "s")}
    ours = Trainer(
        model=_llama_out_of_memory_above(2), args=args(placement), train_dataset=ArithmeticSequences(),
        zeroinf_config=zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload),
    )
    ours.train()
    assert plain._train_batch_size == ours._train_batch_size == 2
    want, got = logged(plain), logged(ours)
    assert sorted(got) == [1, 2, 3, 4] and got == pytest.approx(want, rel=RTOL)
    mine = ours.model.state_dict()
    for name, ref in plain.model.state_dict().items():
        torch.testing.assert_close(mine[name], ref, rtol=RTOL, atol=ATOL)


def test_world2_matches_plain_trainer_and_its_checkpoints_resume_in_one_process(tmp_path, plain_llama) -> None:
    from transformers import LlamaForCausalLM

    ranks = run_ranks(train_rank, 2, "llama", 3, str(tmp_path), timeout_s=240)
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the logged loss is the mean over ranks
    _assert_parity(ranks[0], plain_llama, "stage 3, world 2")
    trained = ranks[0]["weights"]
    for folder in ("final", "run/checkpoint-4"):  # save_model (gathered) and a checkpoint (consolidated)
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        assert all(torch.equal(loaded[n], t) for n, t in trained.items()), folder
    # the world-2 checkpoint of step 2 resumes at world 1 (resharded), on the same global batches
    resumed = run_zeroinf(
        "llama", str(tmp_path / "resumed"), stage=2, resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2")
    )
    got = summary(resumed)
    for step in (3, 4):
        assert got["loss"][step] == pytest.approx(ranks[0]["loss"][step], rel=RTOL), f"step {step}"
    for name, ref in trained.items():
        torch.testing.assert_close(got["weights"][name], ref, rtol=RTOL, atol=ATOL)


def test_hybrid_sharding_under_the_trainer_matches_the_plain_trainer(tmp_path, plain_llama) -> None:
    """Four ranks in shard groups of two (`Config.shard_group_size=2`) through the Trainer: the logged
    losses, eval loss and weights of the plain Trainer in one process on the same global batches
    (within the fp32 tolerance: two rounds of averaging and clipping over shards); the saved model
    and the consolidated checkpoint hold the trained weights; the checkpoint's rank files are the
    first group's two."""
    from transformers import LlamaForCausalLM

    from tests.integrations._trainer_runs import hybrid_rank

    ranks = run_ranks(hybrid_rank, 4, str(tmp_path), timeout_s=400)
    assert all(r["loss"] == ranks[0]["loss"] for r in ranks)  # the logged loss is the mean over ranks
    _assert_parity(ranks[0], plain_llama, "stage 3, world 4 in groups of 2")
    trained = ranks[0]["weights"]
    for folder in ("final", "run/checkpoint-4"):
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        assert all(torch.equal(loaded[n], t) for n, t in trained.items()), folder
    assert [f for f in ranks[0]["files"] if f.startswith("rank")] == ["rank00000.bin", "rank00001.bin"]


def test_world2_is_bitwise_the_plain_trainers_data_parallelism(tmp_path) -> None:
    """Without clipping, two ranks log bitwise the losses of the plain Trainer at world 2 (DDP) and end
    with bitwise its weights: at stages 0-2 also accumulating (the last micro-step reduces, as DDP's
    no_sync does); at stage 3 without accumulation. Stage 3 reduce-scatters every micro-step (its
    unsharded gradient is freed after each, as DeepSpeed's ZeRO-3 does), so accumulated sums are added
    in another order than DDP's: within the fp32 tolerance. With clipping the norm is summed over
    shards (optim/clip.py), not parameter by parameter as torch's clip_grad_norm_: the tolerance too."""
    from tests.integrations._trainer_runs import ddp_rank

    runs = run_ranks(ddp_rank, 2, str(tmp_path), timeout_s=300)[0]
    assert runs["plain"]["loss"][4] < runs["plain"]["loss"][1] - 0.1, "the reference run must learn something"

    def bitwise(ours: dict, plain: dict) -> bool:
        return (ours["loss"] == plain["loss"] and ours["eval_loss"] == plain["eval_loss"]
                and bitwise_equal(ours["weights"], plain["weights"]))

    for name in ("0", "1", "2", "2-host"):
        assert bitwise(runs[name], runs["plain"]), name
    assert bitwise(runs["3-1"], runs["plain-1"])
    _assert_parity(runs["3"], runs["plain"], "stage 3 accumulating")


def _resume_trainer(output_dir: str, stage: int, seed: int) -> Trainer:
    args = training_arguments(output_dir, max_steps=6, save_strategy="steps", save_steps=3)
    return Trainer(
        model=build_dropout_gpt2(seed), args=args, train_dataset=ArithmeticSequences(rows=48),
        zeroinf_config=zeroinf.Config(stage=stage, persist_threshold_bytes=0),
    )


@pytest.mark.parametrize(("save_stage", "resume_stage"), [(3, 3), (2, 2), (3, 1)])
def test_resume_is_bitwise(tmp_path, save_stage: int, resume_stage: int) -> None:
    whole = _resume_trainer(str(tmp_path / "whole"), save_stage, seed=0)
    whole.train()
    ckpt = tmp_path / "whole" / "checkpoint-3"
    assert (ckpt / "zeroinf" / "latest").is_file() and (ckpt / "scheduler.pt").is_file()

    resumed = _resume_trainer(str(tmp_path / "resumed"), resume_stage, seed=1)  # other weights until loaded
    resumed.train(resume_from_checkpoint=str(ckpt))
    expected, got = logged(whole), logged(resumed)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == expected[step], f"step {step}: resumed {got[step]!r}, uninterrupted {expected[step]!r}"
    assert logged(resumed, "learning_rate") == logged(whole, "learning_rate")
    w_whole, w_resumed = whole.model.state_dict(), resumed.model.state_dict()
    for name, t in w_whole.items():
        assert torch.equal(w_resumed[name], t), name


def test_saved_folders_load_with_from_pretrained(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    trainer = _resume_trainer(str(tmp_path / "run"), stage=3, seed=0)
    trainer.train()
    trained = trainer.model.state_dict()
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "final", tmp_path / "run" / "checkpoint-6"):
        loaded = GPT2LMHeadModel.from_pretrained(folder)
        for name, t in loaded.state_dict().items():
            assert torch.equal(t, trained[name]), f"{folder.name}: {name}"
    assert (tmp_path / "run" / "checkpoint-6" / "model.safetensors.index.json").is_file()  # consolidated
    assert (tmp_path / "final" / "training_args.bin").is_file()


def test_fp16_scales_gradients_and_skips_overflowing_steps(tmp_path) -> None:
    from tests._hf import build

    loss_scale = zeroinf.LossScaleConfig(initial_scale=2.0**30, backoff_factor=2.0**-6)
    trainer = Trainer(
        model=build("llama"),
        args=training_arguments(str(tmp_path), max_steps=8),
        train_dataset=ArithmeticSequences(64),
        zeroinf_config=zeroinf.Config(stage=3, param_dtype="fp16", loss_scale=loss_scale, persist_threshold_bytes=0),
    )
    trainer.train()
    opt = trainer.optimizer
    skipped = trainer.state.global_step - opt.step_count
    assert 1 <= skipped < 8, f"{skipped} overflowing steps: the loss scale must reach the gradients"
    assert opt.loss_scale < 2.0**30
    assert trainer.lr_scheduler.last_epoch == opt.step_count  # the schedule waits on skipped steps
    losses = list(logged(trainer).values())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_load_best_model_at_end_loads_the_plain_trainers_best(tmp_path) -> None:
    """With `greater_is_better=True` on the eval loss, which falls, the best checkpoint is the first:
    at the end both Trainers hold its weights (ours loaded from its sharded zeroinf/ folder, as the
    Trainer loads a DeepSpeed checkpoint), not those of the last step."""
    best = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                metric_for_best_model="eval_loss", greater_is_better=True)
    plain_trainer = run_plain("llama", str(tmp_path / "plain"), **best)
    ours_trainer = run_zeroinf("llama", str(tmp_path / "ours"), 3, **best)
    for trainer in (plain_trainer, ours_trainer):
        assert os.path.basename(trainer.state.best_model_checkpoint) == "checkpoint-1"
    plain, ours = summary(plain_trainer), summary(ours_trainer)
    last = summary(run_zeroinf("llama", str(tmp_path / "last"), 3))["weights"]
    assert any(not torch.allclose(ours["weights"][name], last[name]) for name in last)  # the best was loaded
    for name, ref in plain["weights"].items():
        torch.testing.assert_close(ours["weights"][name], ref, rtol=RTOL, atol=ATOL, msg=name)
    assert ours["eval_loss"] == pytest.approx(plain["eval_loss"], rel=RTOL)


def test_epoch_not_divisible_by_accumulation_is_refused_before_training(tmp_path) -> None:
    from tests._hf import build

    trainer = Trainer(
        model=build("llama"), args=training_arguments(str(tmp_path), max_steps=-1, num_train_epochs=2),
        train_dataset=ArithmeticSequences(rows=12),  # 3 batches of 4 per epoch, accumulation 2
        zeroinf_config=zeroinf.Config(stage=2),
    )
    with pytest.raises(TrainerArgumentsError, match=r"3 batches per rank.*max_steps <= 1"):
        trainer.train()


@pytest.mark.parametrize("stage", [1, 3])
def test_another_optim_is_the_plain_trainers_torch_optimizer_sharded(tmp_path, stage: int) -> None:
    """`optim="sgd"` (with momentum through optim_args): the Trainer picks torch's SGD as the plain one
    does and shards its update with zeroinf.ShardedOptimizer; the same losses, norms and weights."""
    overrides = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 1.0}
    plain = summary(run_plain("llama", str(tmp_path / "plain"), **overrides))
    trainer = run_zeroinf("llama", str(tmp_path / "ours"), stage, **overrides)
    assert isinstance(trainer.optimizer, zeroinf.ShardedOptimizer)
    assert trainer.optimizer.optimizer_class is torch.optim.SGD
    assert [g["momentum"] for g in trainer.optimizer.param_groups] == [0.9, 0.9]
    _assert_parity(summary(trainer), plain, f"sgd, stage {stage}")


def test_bitsandbytes_32bit_lion_is_zeroinf_lion_over_the_shards(tmp_path) -> None:
    """`optim="lion_32bit"` (bitsandbytes, not needed): zeroinf.Lion over the shards with the Trainer's
    lr and betas and its decay groups; the same losses, norms and weights as the plain Trainer running
    zeroinf.Lion itself on the whole model (`optimizer_cls_and_kwargs`)."""
    plain = summary(run_plain(
        "llama", str(tmp_path / "plain"), learning_rate=1e-2,
        trainer_kwargs={"optimizer_cls_and_kwargs": (zeroinf.Lion, {"lr": 1e-2, "betas": (0.9, 0.95)})},
    ))
    trainer = run_zeroinf("llama", str(tmp_path / "ours"), 3, optim="lion_32bit", learning_rate=1e-2)
    assert isinstance(trainer.optimizer, zeroinf.ShardedOptimizer) and trainer.optimizer.optimizer_class is zeroinf.Lion
    assert [g["betas"] for g in trainer.optimizer.param_groups] == [(0.9, 0.95)] * 2  # the arguments' adam betas
    _assert_parity(summary(trainer), plain, "lion_32bit")


def test_an_optim_that_cannot_be_sharded_is_refused_with_the_reason(tmp_path) -> None:
    with pytest.raises(ValueError, match="Adafactor's update is not elementwise"):
        run_zeroinf("llama", str(tmp_path), 3, optim="adafactor")


def test_refuses_a_foreign_optimizer_and_conflicting_config(tmp_path) -> None:
    from tests._hf import build

    args = training_arguments(str(tmp_path))
    model = build("llama")
    with pytest.raises(TrainerArgumentsError, match=r"pass a zeroinf.AdamW \(or zeroinf.ShardedOptimizer\)"):
        Trainer(model=model, args=args, optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(TrainerArgumentsError, match="grad_accum_steps=4 but gradient_accumulation_steps=2"):
        Trainer(model=build("llama"), args=args, zeroinf_config=zeroinf.Config(grad_accum_steps=4))


@pytest.mark.parametrize("offload", [None, {"params": "nvme", "optimizer": "nvme"}])
def test_resumes_a_plain_trainers_checkpoint(tmp_path, offload) -> None:
    """integrations/trainer.py [Note: resuming a plain Trainer's checkpoint]: the plain Trainer's
    checkpoint-2 (model.safetensors, optimizer.pt in torch.optim's format) resumed at stage 3, in
    memory and on NVMe: steps 3-4 log the uninterrupted plain run's losses and learning rates and end
    with its weights, within the parity tolerances."""
    plain = run_plain("llama", str(tmp_path / "plain"), save_strategy="steps", save_steps=2)
    ckpt = tmp_path / "plain" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file() and not (ckpt / "zeroinf").exists()
    if offload is not None:
        offload = zeroinf.OffloadConfig(**offload, nvme_dir=str(tmp_path / "swap"))
    resumed = run_zeroinf("llama", str(tmp_path / "ours"), 3, resume_from_checkpoint=str(ckpt), offload=offload)
    expected, got = logged(plain), logged(resumed)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=RTOL), step
    assert logged(resumed, "learning_rate") == logged(plain, "learning_rate")
    weights = resumed.model.state_dict()
    for name, ref in plain.model.state_dict().items():
        torch.testing.assert_close(weights[name], ref, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


def _resume_plain_rank(rank: int, world: int, ckpt: str, root: str) -> dict:
    trainer = run_zeroinf("llama", root, 3, resume_from_checkpoint=ckpt, per_device_train_batch_size=4 // world)
    return summary(trainer, rank)


def test_a_plain_trainers_checkpoint_resumes_at_world_2(tmp_path) -> None:
    """The plain Trainer's world-1 checkpoint-2 resumed by two ranks (per-rank batch 2: the same global
    batches): steps 3-4 and the final weights as the uninterrupted plain run, both ranks logging alike."""
    plain = run_plain("llama", str(tmp_path / "plain"), save_strategy="steps", save_steps=2)
    ckpt = str(tmp_path / "plain" / "checkpoint-2")
    ranks = run_ranks(_resume_plain_rank, 2, ckpt, str(tmp_path / "ours"), timeout_s=240)
    assert ranks[0]["loss"] == ranks[1]["loss"]
    expected = logged(plain)
    for step in (3, 4):
        assert ranks[0]["loss"][step] == pytest.approx(expected[step], rel=RTOL), step
    for name, ref in plain.model.state_dict().items():
        torch.testing.assert_close(
            ranks[0]["weights"][name], ref, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_resume_needs_a_zeroinf_checkpoint(tmp_path) -> None:
    from tests._hf import build

    os.makedirs(tmp_path / "checkpoint-2")
    trainer = Trainer(model=build("llama"), args=training_arguments(str(tmp_path)), train_dataset=ArithmeticSequences())
    with pytest.raises(ValueError, match="has no zeroinf/ folder.*or from a plain Trainer's"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_lora_with_checkpointing_matches_plain_trainer_and_saves_adapters(tmp_path) -> None:
    from peft import PeftModel

    plain = run_plain_lora(str(tmp_path / "plain"))
    ranks = run_ranks(lora_rank, 2, str(tmp_path), timeout_s=240)
    ours = ranks[0]
    assert ours["engine_checkpoints"] is True and ours["model_checkpoints"] is False, ours
    for key in ("loss", "grad_norm"):
        for step, ref in plain[key].items():
            assert ours[key][step] == pytest.approx(ref, rel=RTOL), f"step {step} {key}"
    assert sorted(ours["adapters"]) == sorted(plain["adapters"])
    for name, ref in plain["adapters"].items():
        torch.testing.assert_close(ours["adapters"][name], ref, rtol=RTOL, atol=ATOL, msg=name)
    for folder in (tmp_path / "final", tmp_path / "run" / "checkpoint-4"):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(folder)), folder
        assert not any(f.startswith("model") for f in os.listdir(folder)), folder
        loaded = PeftModel.from_pretrained(lora_llama().get_base_model(), folder)
        state = loaded.state_dict()
        for name, ref in plain["adapters"].items():
            torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=f"{folder}: {name}")
    # the world-2 checkpoint of step 2 resumes in one process to the uninterrupted run's adapters
    args = training_arguments(str(tmp_path / "resumed"), gradient_checkpointing=True)
    resumed = Trainer(model=lora_llama(), args=args, train_dataset=ArithmeticSequences(),
                      zeroinf_config=zeroinf.Config(stage=2))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for step in (3, 4):
        assert logged(resumed)[step] == pytest.approx(ours["loss"][step], rel=RTOL), f"step {step}"
    state = resumed.model.state_dict()
    for name, ref in ours["adapters"].items():
        torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL, msg=name)


def test_seq2seq_trainer_generates_as_the_plain_one(tmp_path) -> None:
    import transformers

    plain = seq2seq_run(transformers.Seq2SeqTrainer, str(tmp_path / "plain"))
    ours = seq2seq_run(Seq2SeqTrainer, str(tmp_path / "ours"), zeroinf_config=zeroinf.Config(stage=3))
    for step, ref in plain["loss"].items():
        assert ours["loss"][step] == pytest.approx(ref, rel=RTOL), f"step {step}"
    assert ours["tokens"] == plain["tokens"]
    assert ours["test_loss"] == pytest.approx(plain["test_loss"], rel=RTOL)


def test_a_bf16_model_built_under_init_with_exact_masters_trains_as_the_eagerly_built_one(tmp_path) -> None:
    """`zeroinf.init(cfg, exact_masters=True)` and the Trainer sharding the model: the eager build's
    logged losses, bit for bit, in bf16 (the default init departs after its first update: the masters
    start rounded; partition/park.py [Note: exact masters under zeroinf.init])."""
    from tests._hf import build

    def run(variant: str) -> dict[int, float]:
        folder = tmp_path / variant
        folder.mkdir()
        offload = zeroinf.OffloadConfig(params="nvme", nvme_dir=str(folder))
        cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, param_dtype="bf16", offload=offload)
        if variant == "eager":
            model = build("llama")
        else:
            with zeroinf.init(cfg, exact_masters=variant == "exact"):
                model = build("llama")
        trainer = Trainer(
            model=model, args=training_arguments(str(folder / "out"), bf16=True), train_dataset=ArithmeticSequences(),
            eval_dataset=EVAL_DATA, zeroinf_config=cfg,
        )
        trainer.train()
        return logged(trainer)

    eager, exact, rounded = run("eager"), run("exact"), run("init")
    assert exact == eager, (exact, eager)
    assert rounded[1] == eager[1] and rounded != eager, (rounded, eager)


def test_save_on_each_node_keeps_each_machines_checkpoint_on_its_disk(tmp_path, plain_llama) -> None:
    """`save_on_each_node=True` with machines that share no disk (two ranks, each a machine of its
    own with its own folder): each checkpoint holds that machine's rank's states (node-local,
    checkpoint/saving.py [Note: node-local checkpoints]) and the model's weights, and new processes
    resume from their own disks with the straight run's losses."""
    from transformers import LlamaForCausalLM

    ranks = run_ranks(each_node_rank, 2, str(tmp_path), False, timeout_s=240)
    _assert_parity(ranks[0], plain_llama, "stage 3, world 2, save_on_each_node")
    for rank, got in enumerate(ranks):
        for step in (2, 4):
            assert got["files"][step] == ["manifest.json", "module_state.bin", f"rank{rank:05d}.bin"], (rank, got)
        assert got["weights_files"] == ["model.safetensors"], got["weights_files"]
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / f"machine{rank}" / "run" / "checkpoint-4").state_dict()
        assert all(torch.equal(loaded[n], t) for n, t in ranks[0]["weights"].items()), rank
    resumed = run_ranks(each_node_rank, 2, str(tmp_path), True, timeout_s=240)
    for step in (3, 4):
        assert resumed[0]["loss"][step] == ranks[0]["loss"][step], f"step {step}"
