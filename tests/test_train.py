"""`zeroinf train`: the schedule, short runs that learn, two ranks agreeing with one, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

import zeroinf
from tests._harness import run_ranks
from zeroinf import cli
from zeroinf.config import Config
from zeroinf.train import TrainArgs, TrainResult, lr_factor, train

TINY_RUN = dict(
    model="tiny",
    seq_len=32,
    global_batch=8,
    lr=3e-3,
    warmup_steps=3,
    eval_batches=2,
    max_corpus_bytes=2**20,
    progress=False,
)


def test_lr_factor_warms_up_then_decays_to_the_floor() -> None:
    assert lr_factor(0, warmup_steps=10, total_steps=100, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(9, warmup_steps=10, total_steps=100, min_ratio=0.1) == pytest.approx(1.0)
    assert lr_factor(10, warmup_steps=10, total_steps=100, min_ratio=0.1) == pytest.approx(1.0)
    assert lr_factor(55, warmup_steps=10, total_steps=100, min_ratio=0.1) == pytest.approx(0.55)
    assert lr_factor(100, warmup_steps=10, total_steps=100, min_ratio=0.1) == pytest.approx(0.1)


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("log_interval", 0, "log_interval = 0 is invalid"),  # was a ZeroDivisionError at the first step
    ("warmup_steps", -1, "warmup_steps = -1 (--warmup) is invalid"),
    ("min_lr_ratio", 1.5, "min_lr_ratio = 1.5 is invalid: use a number in [0, 1]"),
    ("steps", 0, "steps = 0 (--steps) is invalid"),
    ("global_batch", 2.5, "global_batch = 2.5 (--batch) is invalid"),
    ("seq_len", True, "seq_len = True (--seq-len) is invalid"),
    ("lr", -1e-3, "lr = -0.001 (--lr) is invalid"),
    ("weight_decay", float("nan"), "weight_decay = nan (--weight-decay) is invalid"),
    ("betas", (0.9, 1.0), "betas = (0.9, 1.0) is invalid: use two numbers in [0, 1)"),
    ("save_every", -2, "save_every = -2 (--save-every) is invalid"),
    ("n_layer", 0, "n_layer = 0 (--n-layer) is invalid"),
    ("eval_batches", -1, "eval_batches = -1 is invalid"),
    ("max_corpus_bytes", 0, "max_corpus_bytes = 0 is invalid"),
])
def test_bad_run_settings_are_refused_by_name(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        TrainArgs(**{field: value})  # type: ignore[arg-type]
    assert fragment in str(info.value), str(info.value)


def test_short_run_learns_and_reports(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = train(TrainArgs(**TINY_RUN, steps=30, config=Config(stage=2), report_path=str(report)))
    assert len(result.losses) == 30
    assert result.first_loss == pytest.approx(math.log(256), abs=0.3)
    assert result.last_loss < result.first_loss - 1.0
    assert result.val_loss is not None and math.isfinite(result.val_loss)
    assert result.tokens_per_s > 0 and result.skipped_steps == 0
    assert result.memory["device"]["peak_bytes"] > 0
    saved = json.loads(report.read_text())
    assert saved["losses"] == result.losses and saved["engine_config"]["stage"] == 2


def test_user_text_bf16_and_grad_accum(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    config = Config(stage=1, param_dtype="bf16", grad_accum_steps=2, grad_clip_norm=1.0)
    result = train(TrainArgs(**TINY_RUN, steps=20, data=[str(text)], config=config))
    assert result.last_loss < result.first_loss - 1.0


def _train_on_ranks(rank: int, world_size: int) -> list[float]:
    args = TrainArgs(**{**TINY_RUN, "eval_batches": 0}, steps=4, config=Config(stage=2))
    return train(args).losses


def test_two_ranks_match_one_process() -> None:
    """The same global batches on 1 or 2 ranks give the same losses (rank-averaged, fp32)."""
    single = _train_on_ranks(0, 1)
    per_rank = run_ranks(_train_on_ranks, 2)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(single, rel=1e-4)


def test_cli_train_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    argv = [
        "train",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--batch",
        "4",
        "--seq-len",
        "32",
        "--eval-batches",
        "1",
        "--dtype",
        "fp32",
        "--report",
        str(report),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "loss:" in out and "val loss:" in out and "peak engine memory" in out
    assert len(json.loads(report.read_text())["losses"]) == 3


def test_cli_states_the_ssd_writes_of_an_nvme_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--model", "tiny", "--steps", "2", "--batch", "2", "--seq-len", "16", "--eval-batches", "0",
            "--dtype", "fp32", "--stage", "3", "--offload-params", "nvme", "--offload-optimizer", "nvme",
            "--nvme-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    wear = [line for line in out.splitlines() if line.startswith("nvme per rank: about ")]
    assert len(wear) == 1 and "B written a step, " in wear[0] and "B per 10,000 steps" in wear[0], out


def test_cli_reports_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--model", "tiny", "--steps", "1", "--no-progress", "--data", str(tmp_path / "nope.txt")]
    assert cli.main(argv) == 2
    assert "nope.txt" in capsys.readouterr().err


def test_cli_overrides_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "train.toml"
    path.write_text('stage = 1\nparam_dtype = "fp32"\ngrad_accum_steps = 4\n')
    ns = cli.build_parser().parse_args(["train", "--config", str(path), "--dtype", "bf16", "--clip", "0.5"])
    cfg = cli.engine_config(ns)
    assert (cfg.stage, cfg.param_dtype, cfg.grad_accum_steps, cfg.grad_clip_norm) == (1, "bf16", 4, 0.5)
    ns = cli.build_parser().parse_args(["train", "--config", str(path), "--shard-group-size", "2"])
    assert cli.engine_config(ns).shard_group_size == 2


def test_cli_max_host_bytes_sets_the_cap_for_the_split(tmp_path: Path) -> None:
    ns = cli.build_parser().parse_args(["train", "--stage", "3", "--offload-optimizer", "host",
                                        "--nvme-dir", str(tmp_path), "--max-host-bytes", "2GiB"])
    cfg = cli.engine_config(ns)
    assert (cfg.offload.optimizer, cfg.offload.max_host_bytes, cfg.offload.nvme_dir) == ("host", 2**31, str(tmp_path))


def test_cli_param_cache_sets_the_nvme_parameter_cache(tmp_path: Path) -> None:
    ns = cli.build_parser().parse_args(["train", "--stage", "3", "--offload-params", "nvme",
                                        "--nvme-dir", str(tmp_path), "--param-cache", "1GiB"])
    cfg = cli.engine_config(ns)
    assert (cfg.offload.params, cfg.offload.param_cache_bytes) == ("nvme", 2**30)


def test_nproc_relaunches_through_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    assert cli.main(["train", "--nproc", "2", "--steps", "5", "--nproc=2"]) == 3
    (command,) = calls
    assert command[1:4] == ["-m", "zeroinf.launch", "--standalone"]  # torch.distributed.run, quiet on user errors
    assert "--nproc-per-node=2" in command
    assert command[command.index("zeroinf") - 1 :] == ["-m", "zeroinf", "train", "--steps", "5"]


def test_train_result_is_plain_data() -> None:
    result = TrainResult(
        losses=[1.0],
        start_step=0,
        step_times_s=[0.5],
        first_loss=1.0,
        last_loss=1.0,
        val_loss=None,
        tokens_per_s=1.0,
        wall_time_s=1.0,
        skipped_steps=0,
        param_count=1,
        world_size=1,
    )
    assert json.loads(json.dumps(result.summary()))["first_loss"] == 1.0


def test_cli_bench_io_delegates(tmp_path: Path) -> None:
    pytest.importorskip("zeroinf.aio.bench")
    assert cli.main(["bench-io", "--dir", str(tmp_path), "--size", "1MiB", "--json"]) == 0


def test_save_every_and_resume_continue_the_straight_run_exactly(tmp_path: Path) -> None:
    """10 steps straight (saving at 5 and 10) vs resuming at 5 in a fresh run: fp32 losses bitwise equal,
    the LR schedule and data position included; stage 3 with states on NVMe, resumed on NVMe and in memory.
    (Into another stage, see tests/checkpoint/test_elastic.py: stage 2 and 3 differ by rounding.)"""
    offload = dict(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path / "swap"))
    (tmp_path / "swap").mkdir()
    root = str(tmp_path / "ckpt")
    base = {**TINY_RUN, "eval_batches": 0, "steps": 10}
    on_nvme = Config.from_dict({"stage": 3, "persist_threshold_bytes": 0, "offload": offload})
    straight = train(TrainArgs(**base, config=on_nvme, save_every=5, save_dir=root))
    assert sorted(p.name for p in Path(root).iterdir()) == ["latest", "step_00000005", "step_00000010"]
    resumed = train(TrainArgs(**base, config=Config(stage=3, persist_threshold_bytes=0,
                                            offload=zeroinf.OffloadConfig(**offload)),
                              resume=f"{root}/step_00000005"))
    assert resumed.start_step == 5 and len(resumed.losses) == 5
    assert resumed.losses == straight.losses[5:]
    # into another placement (everything in memory): still bitwise, since only where the states live changed
    other = train(TrainArgs(**base, config=Config(stage=3), resume=f"{root}/step_00000005"))
    assert other.losses == straight.losses[5:]
    with pytest.raises(ValueError, match="nothing to train"):  # the root's `latest` is step 10 of 10
        train(TrainArgs(**base, config=Config(stage=2), resume=root))


def test_init_from_starts_a_new_run_from_a_checkpoints_weights(tmp_path: Path, capsys) -> None:
    """`--init-from CKPT`: a new run (step 0, new optimizer, schedule and data order) from the weights
    of a checkpoint saved at stage 3 on NVMe, here at stage 2 in memory: bitwise plain PyTorch's loop
    started from that checkpoint's consolidated fp32 weights."""
    import torch
    from safetensors.torch import load_file

    from zeroinf.data import BatchSampler, load_corpus, split_corpus
    from zeroinf.models.gpt import GPT
    from zeroinf.train import param_groups

    (tmp_path / "swap").mkdir()
    root = str(tmp_path / "ckpt")
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path / "swap"))
    base = {**TINY_RUN, "eval_batches": 0}
    train(TrainArgs(**base, steps=4, config=Config(stage=3, persist_threshold_bytes=0, offload=offload),
                    save_every=4, save_dir=root))
    args = TrainArgs(**base, steps=5, config=Config(stage=2), init_from=root)
    new = train(args)
    assert new.start_step == 0 and len(new.losses) == 5
    zeroinf.consolidate(root, str(tmp_path / "weights"), dtype="fp32")
    model = GPT(args.model_config())
    weights = {}
    for f in sorted((tmp_path / "weights").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    model.load_state_dict(weights, strict=False)
    assert {n for n, _ in model.named_parameters()} <= weights.keys()
    train_bytes, _ = split_corpus(load_corpus(None, args.max_corpus_bytes), args.val_fraction)
    sampler = BatchSampler(train_bytes, args.seq_len, args.global_batch, seed=args.seed, rank=0, world_size=1)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=args.betas, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup_steps, args.steps, args.min_lr_ratio)
    )
    assert new.losses == _plain_losses(model, opt, sched, sampler, args.steps)
    assert cli.main(["train", "--model", "tiny", "--steps", "2", "--init-from", root, "--resume", root,
                     "--no-progress"]) == 2
    assert "--init-from and --resume both given" in capsys.readouterr().err


def test_cli_save_needs_a_folder_and_resume_names_a_bad_checkpoint(tmp_path: Path, capsys) -> None:
    assert cli.main(["train", "--model", "tiny", "--steps", "2", "--save-every", "1", "--no-progress"]) == 2
    assert "--save-every 1 needs --save-dir" in capsys.readouterr().err
    assert cli.main(["train", "--model", "tiny", "--steps", "2", "--resume", str(tmp_path), "--no-progress"]) == 2
    assert str(tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("stage", [2, 3])
def test_demo_loop_equals_plain_pytorch_bitwise(stage: int) -> None:
    """fp32, world 1: the demo's loop (weight-decay groups, LR schedule) through zeroinf reproduces
    `torch.optim.AdamW(fused=True)` bitwise. (Stage 3 once lost the groups: p.dim() of placeholders.)"""
    import torch

    from zeroinf.data import BatchSampler, load_corpus, split_corpus
    from zeroinf.models.gpt import GPT
    from zeroinf.train import param_groups

    args = TrainArgs(**{**TINY_RUN, "eval_batches": 0}, steps=6, config=Config(stage=stage))
    train_bytes, _ = split_corpus(load_corpus(None, args.max_corpus_bytes), args.val_fraction)
    sampler = BatchSampler(train_bytes, args.seq_len, args.global_batch, seed=args.seed, rank=0, world_size=1)
    torch.manual_seed(args.seed)
    model = GPT(args.model_config())
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=args.betas, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup_steps, args.steps, args.min_lr_ratio)
    )
    assert train(args).losses == _plain_losses(model, opt, sched, sampler, args.steps)


def _plain_losses(model, opt, sched, sampler, steps: int) -> list[float]:
    """The demo's loop in plain PyTorch: the reference the zeroinf runs are compared with."""
    plain = []
    for step in range(steps):
        ((inputs, targets),) = sampler.micro_batches(step)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        plain.append(float(loss.detach()))
    return plain


def test_a_deepspeed_configs_optimizer_and_scheduler_make_the_runs(tmp_path: Path, capsys) -> None:
    """`zeroinf train --deepspeed ds.json`: the file's optimizer and scheduler sections make the
    optimizer and the LR schedule (its weight decay on the matrices only, as the run's groups say),
    bitwise torch's fused AdamW under the same schedule; no scheduler section: a constant learning
    rate, as under DeepSpeed; "auto" values (a Hugging Face Trainer config) from the run's settings.
    A flag setting what the section sets is refused, naming both; one the file leaves unset fills it."""
    import torch

    from zeroinf.data import BatchSampler, load_corpus, split_corpus
    from zeroinf.deepspeed_optimizer import DeepSpeedSchedule
    from zeroinf.models.gpt import GPT
    from zeroinf.train import param_groups

    adamw = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-7, "weight_decay": 0.05}}
    schedule = {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 2, "total_num_steps": 6}
    auto = {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")}
    variants = {  # name: (sections, eps, schedule)
        "schedule": ({"optimizer": adamw, "scheduler": {"type": "WarmupDecayLR", "params": schedule}}, 1e-7, True),
        "constant": ({"optimizer": adamw}, 1e-7, False),
        "auto": ({"optimizer": auto, "scheduler": {"type": "WarmupDecayLR",
                                                   "params": dict.fromkeys(schedule, "auto")}}, 1e-8, True),
    }
    for name, (sections, eps, scheduled) in variants.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 1}, **sections}))
        args = TrainArgs(**{**TINY_RUN, "eval_batches": 0, "warmup_steps": 2}, steps=6, weight_decay=0.05,
                         config=Config.from_deepspeed(str(path)), deepspeed=str(path))
        train_bytes, _ = split_corpus(load_corpus(None, args.max_corpus_bytes), args.val_fraction)
        sampler = BatchSampler(train_bytes, args.seq_len, args.global_batch, seed=args.seed, rank=0, world_size=1)
        torch.manual_seed(args.seed)
        model = GPT(args.model_config())
        opt = torch.optim.AdamW(param_groups(model, 0.05), lr=3e-3, betas=(0.9, 0.95), eps=eps, fused=True)
        sched = DeepSpeedSchedule(opt, "WarmupDecayLR", **schedule) if scheduled else None
        assert train(args).losses == _plain_losses(model, opt, sched, sampler, args.steps), name
    assert cli.main(["train", "--deepspeed", str(tmp_path / "constant.json"), "--lr", "1e-3", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--lr (optimizer.params.lr): set by DeepSpeed config" in err and "drop the flag" in err, err
    finetune = ["finetune", "--model", "m", "--data", "d.jsonl", "--deepspeed", str(tmp_path / "schedule.json")]
    assert cli.main([*finetune, "--weight-decay", "0.1", "--warmup", "3"]) == 2
    err = capsys.readouterr().err
    assert "--warmup (scheduler.params.warmup_num_steps), --weight-decay (optimizer.params.weight_decay)" in err, err
    # a flag fills what the file leaves unset (here the learning rate: DeepSpeed's default otherwise)
    (tmp_path / "bare.json").write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {}}}))
    ns = cli.build_parser().parse_args(["train", "--deepspeed", str(tmp_path / "bare.json"), "--lr", "0.004"])
    settings = cli.optimizer_settings(ns, TrainArgs)
    assert settings["lr"] == 0.004 and settings["deepspeed"]["optimizer"]["params"] == {"lr": 0.004}
