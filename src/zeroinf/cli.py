"""The `zeroinf` command line: `zeroinf train`, `finetune`, `plan`, `bench-io` and `consolidate`.

zeroinf train                          # the demo GPT on the standard library's sources
zeroinf train --nproc 2 --stage 2      # two ranks on this machine (through torch.distributed.run)
zeroinf train --deepspeed ds.json      # engine settings from a DeepSpeed config
zeroinf train --offload auto           # the fastest placement this machine fits (see `zeroinf plan`)
zeroinf plan --hf path/to/model        # every placement's memory per tier and step time, no weights read
torchrun --nproc-per-node 8 -m zeroinf train --model 125m --config train.toml

Every error that is the user's to fix (a bad option value, a bad or missing config file, a missing
folder, a bad checkpoint, a full disk) ends the command with one line on stderr and exit status 2;
anything else is a bug and keeps its traceback (`USER_ERRORS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from zeroinf import launch
from zeroinf.checkpoint.format import CheckpointError
from zeroinf.config import AUTO, DTYPES, MOMENT_DTYPES, Config, OffloadConfig
from zeroinf.models.gpt import PRESETS
from zeroinf.telemetry import configure_cli_logging
from zeroinf.topology import check_ranks_fit
from zeroinf.train import DEFAULT_CONFIG, TrainArgs, available_cores, train

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, CheckpointError)
"""Exceptions the command line reports on one line: ValueError covers ConfigError and unparsable
values or files (JSON, TOML, sizes), OSError missing files and folders, I/O failures (AioError) and
timeouts, CheckpointError a checkpoint that is missing, corrupt or does not fit."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, like the command line's other errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `zeroinf train`; their defaults are those of `zeroinf.train.TrainArgs`."""
    d = TrainArgs()
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=d.model, choices=sorted(PRESETS), help="GPT preset (default: %(default)s)")
    model.add_argument("--n-layer", type=int, help="override the preset's number of blocks")
    model.add_argument("--n-head", type=int, help="override the preset's number of attention heads")
    model.add_argument("--d-model", type=int, help="override the preset's residual width")
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    run.add_argument(
        "--batch",
        type=int,
        default=d.global_batch,
        help="global batch: sequences per step over all ranks (default: %(default)s)",
    )
    run.add_argument("--seq-len", type=int, default=d.seq_len, help="bytes per sequence (default: %(default)s)")
    add_optimizer_arguments(run, d)
    run.add_argument("--seed", type=int, default=d.seed, help="seed of init and batches (default: %(default)s)")
    run.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="text files to train on (default: the Python standard library's sources)",
    )
    run.add_argument(
        "--eval-batches",
        type=int,
        default=d.eval_batches,
        help="validation batches at the end, 0 to skip (default: %(default)s)",
    )
    run.add_argument(
        "--init-from", metavar="CKPT",
        help="start from the weights of a zeroinf checkpoint (its fp32 masters; root or step folder, any world "
        "size), with a new optimizer, LR schedule and data order from step 0: a new phase of training, where "
        "--resume continues the same run",
    )
    add_engine_arguments(parser)
    add_launch_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by `train` and `finetune`: a config file and per-field overrides."""
    engine = parser.add_argument_group("engine (override the fields of --config or --deepspeed)")
    source = engine.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="zeroinf config, .toml or .json")
    source.add_argument(
        "--deepspeed",
        metavar="FILE",
        help="DeepSpeed JSON config, translated by zeroinf.Config.from_deepspeed (docs/migrating-from-deepspeed.md)",
    )
    engine.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    engine.add_argument(
        "--dtype", choices=[*sorted(DTYPES), AUTO], help="parameter (compute) dtype; auto: bf16 where native, else fp32"
    )
    engine.add_argument("--grad-accum", type=int, metavar="N", help="micro-steps per optimizer step")
    engine.add_argument("--clip", type=float, metavar="NORM", help="clip the global gradient norm to NORM")
    engine.add_argument(
        "--shard-group-size", type=int, metavar="N",
        help="hybrid sharding: shard within groups of N consecutive ranks (a machine's GPUs), replicate across them",
    )
    tiers = ("device", "host", "nvme")
    engine.add_argument("--offload-params", choices=tiers, help="tier of the parameter shards (host/nvme: stage 3)")
    engine.add_argument("--offload-optimizer", choices=tiers, help="tier of the fp32 master weights and moments")
    engine.add_argument("--offload-gradients", choices=tiers, help="tier of the gradient shards (stage 2-3)")
    engine.add_argument(
        "--offload", choices=(AUTO,),
        help="auto: the fastest predicted placement that fits (stage unless --stage, and the three tiers; "
        "printed with its prediction before training)",
    )
    engine.add_argument(
        "--nvme-dir", metavar="DIR", help="folder for the swap files (default: a temporary folder, removed at exit)"
    )
    add_host_memory_arguments(engine)


def add_host_memory_arguments(group: argparse._ArgumentGroup) -> None:
    """`--max-host-bytes`, `--param-cache` and `--moment-dtype`, shared by train, finetune and plan."""
    group.add_argument(
        "--max-host-bytes", metavar="SIZE",
        help="cap on host memory for offload, e.g. 16GiB; with --nvme-dir, host parameter shards and optimizer "
        "states beyond it go to NVMe (split by unit)",
    )
    group.add_argument(
        "--param-cache", metavar="SIZE",
        help="host memory that keeps parameter shards on NVMe between uses, e.g. 4GiB (offload.param_cache_bytes)",
    )
    group.add_argument(
        "--moment-dtype", choices=MOMENT_DTYPES,
        help="dtype of Adam's two moments: bf16 keeps 8 bytes of optimizer state per parameter instead of 12, "
        "rounded stochastically (offload.moment_dtype)",
    )


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Launch, checkpoint and report options shared by `train` and `finetune`."""
    launch = parser.add_argument_group("launch and output")
    launch.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="ranks to start on this machine through torch.distributed.run (default: 1)",
    )
    launch.add_argument(
        "--report", metavar="FILE",
        help="write the summary as JSON to FILE, and one steady step as <stem>.timeline.html (phases, predicted "
        "vs measured) and <stem>.trace.json (Perfetto / chrome://tracing)",
    )
    launch.add_argument("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps to --save-dir")
    launch.add_argument("--save-dir", metavar="DIR", help="checkpoint root (step folders and a `latest` pointer)")
    launch.add_argument(
        "--keep-last", type=int, default=0, metavar="N",
        help="keep only the N newest checkpoints in --save-dir, removing older ones once a new one is saved (0: all)",
    )
    launch.add_argument(
        "--save-node-local", action="store_true",
        help="--save-dir is each machine's own disk: each keeps its ranks' states (resume with the same ranks there)",
    )
    launch.add_argument(
        "--resume", metavar="CKPT", help="continue from a checkpoint root (its latest) or step folder, any world size"
    )
    launch.add_argument("--no-progress", action="store_true", help="no progress bar and no summary")


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `zeroinf finetune`; defaults are those of `zeroinf.finetune.FinetuneArgs`."""
    from zeroinf.finetune import FinetuneArgs

    d = FinetuneArgs(model="", data=["-"])
    what = parser.add_argument_group("model and data")
    what.add_argument(
        "--model", required=True, metavar="DIR", help="a Hugging Face model folder (config + safetensors)"
    )
    what.add_argument("--data", required=True, nargs="+", metavar="FILE", help=".txt or .jsonl files")
    what.add_argument("--format", default=d.format, choices=("auto", "text", "jsonl"), help="(default: by extension)")
    what.add_argument("--text-field", default=d.text_field, help="the JSON field holding the text (default: text)")
    what.add_argument(
        "--lora-rank", type=int, default=d.lora_rank, help="LoRA rank, 0 for a full fine-tune (default: %(default)s)"
    )
    what.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: twice the rank)")
    what.add_argument("--lora-targets", default=d.lora_targets, help="modules with adapters (default: all-linear)")
    what.add_argument("--out", metavar="DIR", help="write the fine-tuned model (LoRA merged) as a Hugging Face folder")
    run = parser.add_argument_group("run")
    length = run.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default: one epoch)")
    length.add_argument("--epochs", type=float, help="passes over the tokens")
    run.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default: %(default)s)")
    run.add_argument(
        "--batch", type=int, default=d.global_batch, help="sequences per step, all ranks (default: %(default)s)"
    )
    add_optimizer_arguments(run, d)
    run.add_argument("--seed", type=int, default=d.seed, help="seed of the adapters and batches (default: %(default)s)")
    add_engine_arguments(parser)
    add_launch_arguments(parser)


def add_optimizer_arguments(run: Any, d: Any) -> None:
    """--lr, --warmup and --weight-decay of train and finetune: None when not given, so that they can
    be told apart from a DeepSpeed config's optimizer and scheduler sections (`optimizer_settings`)."""
    run.add_argument("--lr", type=float, help=f"peak learning rate (default: {d.lr})")
    run.add_argument("--warmup", type=int, help=f"warm-up steps (default: {d.warmup_steps})")
    run.add_argument("--weight-decay", type=float, help=f"(default: {d.weight_decay})")


def optimizer_settings(ns: argparse.Namespace, d: Any) -> dict[str, Any]:
    """lr, warmup_steps, weight_decay and deepspeed for the run's arguments: the flags given, else
    the defaults. With --deepspeed, a file with an `optimizer` section makes the optimizer (and its
    `scheduler` the schedule); a flag given fills the values it leaves "auto" or unset, and one it
    sets itself is refused beside the flag (both would set the same thing)."""
    given = {"--lr": ns.lr, "--warmup": ns.warmup, "--weight-decay": ns.weight_decay}
    settings: dict[str, Any] = {
        "lr": d.lr if ns.lr is None else ns.lr,
        "warmup_steps": d.warmup_steps if ns.warmup is None else ns.warmup,
        "weight_decay": d.weight_decay if ns.weight_decay is None else ns.weight_decay,
        "deepspeed": ns.deepspeed,
    }
    if not ns.deepspeed or all(v is None for v in given.values()):
        return settings
    from zeroinf.deepspeed_config import read_deepspeed

    data, label = read_deepspeed(ns.deepspeed)
    if not isinstance(data.get("optimizer"), dict):
        return settings  # the flags make the optimizer
    from zeroinf.train import DEEPSPEED_AUTO

    # the section keys each flag's field fills (what "auto" there becomes: train.py DEEPSPEED_AUTO)
    fields = {"--lr": "lr", "--warmup": "warmup_steps", "--weight-decay": "weight_decay"}
    keys = {flag: [key for key, by in DEEPSPEED_AUTO.items() if by == field] for flag, field in fields.items()}
    filled = {name: {**data[name], "params": dict(data[name].get("params") or {})}
              for name in ("optimizer", "scheduler") if isinstance(data.get(name), dict)}
    clashes = []
    for flag, value in given.items():
        for section, key in keys[flag]:
            if value is None or section not in filled:
                continue
            params = filled[section]["params"]
            if params.get(key, "auto") != "auto":
                clashes.append(f"{flag} ({section}.params.{key})")
            else:
                params[key] = value
    if clashes:
        raise ValueError(
            f"{', '.join(clashes)}: set by {label} too; with --deepspeed its optimizer and scheduler sections make "
            "the optimizer and the LR schedule, as DeepSpeed's engine does, and a flag fills only the values they "
            'leave "auto" or unset: drop the flag, or write "auto" in the file'
        )
    settings["deepspeed"] = {**data, **filled}
    return settings


def engine_config(ns: argparse.Namespace, default: Config = DEFAULT_CONFIG) -> Config:
    """The config file's settings (or the default ones), with the command-line overrides applied."""
    if ns.deepspeed:
        cfg = Config.from_deepspeed(ns.deepspeed)
    else:
        cfg = Config.load(ns.config) if ns.config else default
    overrides = {
        "stage": ns.stage,
        "param_dtype": ns.dtype,
        "grad_accum_steps": ns.grad_accum,
        "grad_clip_norm": ns.clip,
        "shard_group_size": getattr(ns, "shard_group_size", None),
    }
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    tiers = {"params": ns.offload_params, "optimizer": ns.offload_optimizer, "gradients": ns.offload_gradients}
    if getattr(ns, "offload", None) == AUTO:
        tiers = {k: v or AUTO for k, v in tiers.items()}
        if ns.stage is None:
            cfg = dataclasses.replace(cfg, stage=AUTO)
    tiers = {k: v for k, v in tiers.items() if v is not None}
    cap, cache = getattr(ns, "max_host_bytes", None), getattr(ns, "param_cache", None)
    moments = getattr(ns, "moment_dtype", None)
    if tiers or ns.nvme_dir or cap or cache or moments:
        merged = {**dataclasses.asdict(cfg.offload), **tiers}
        if cap:
            merged["max_host_bytes"] = cap
        if cache:
            merged["param_cache_bytes"] = cache
        if moments:
            merged["moment_dtype"] = moments
        if ns.nvme_dir:
            merged["nvme_dir"] = ns.nvme_dir
        elif {"nvme", AUTO} & {merged["params"], merged["optimizer"], merged["gradients"]} and not merged["nvme_dir"]:
            merged["nvme_dir"] = temporary_swap_folder()
        cfg = dataclasses.replace(cfg, offload=OffloadConfig(**merged))
    return cfg


def temporary_swap_folder() -> str:
    """A fresh folder on the disk under the system temp dir (one per rank), removed at exit."""
    import atexit
    import shutil
    import tempfile

    rank = os.environ.get("RANK", "0")
    folder = tempfile.mkdtemp(prefix=f"zeroinf-swap-rank{rank}-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def run_train(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    if ns.nproc < 1:
        raise ValueError(f"--nproc {ns.nproc} is invalid: use a positive number of ranks")
    # Built (and so validated) before any rank starts: a bad value is one line from this process.
    args = TrainArgs(
        model=ns.model,
        n_layer=ns.n_layer,
        n_head=ns.n_head,
        d_model=ns.d_model,
        steps=ns.steps,
        global_batch=ns.batch,
        seq_len=ns.seq_len,
        **optimizer_settings(ns, TrainArgs),
        seed=ns.seed,
        config=engine_config(ns),
        data=ns.data,
        eval_batches=ns.eval_batches,
        progress=not ns.no_progress,
        report_path=ns.report,
        save_every=ns.save_every,
        save_dir=ns.save_dir,
        keep_last=ns.keep_last,
        save_node_local=ns.save_node_local,
        resume=ns.resume,
        init_from=ns.init_from,
    )
    if ns.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch_with_torchrun(ns.nproc, "train", argv)
    train(args)
    return 0


def run_finetune(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    from zeroinf.finetune import DEFAULT_CONFIG as FINETUNE_CONFIG
    from zeroinf.finetune import FinetuneArgs, finetune

    if ns.nproc < 1:
        raise ValueError(f"--nproc {ns.nproc} is invalid: use a positive number of ranks")
    args = FinetuneArgs(
        model=ns.model, data=ns.data, format=ns.format, text_field=ns.text_field, lora_rank=ns.lora_rank,
        lora_alpha=ns.lora_alpha, lora_targets=ns.lora_targets, steps=ns.steps, epochs=ns.epochs,
        seq_len=ns.seq_len, global_batch=ns.batch, **optimizer_settings(ns, FinetuneArgs),
        seed=ns.seed, config=engine_config(ns, FINETUNE_CONFIG), out=ns.out,
        save_every=ns.save_every, save_dir=ns.save_dir, keep_last=ns.keep_last, save_node_local=ns.save_node_local,
        resume=ns.resume,
        progress=not ns.no_progress, report_path=ns.report,
    )
    if ns.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch_with_torchrun(ns.nproc, "finetune", argv)
    finetune(args)
    return 0


def without_nproc(argv: Sequence[str]) -> list[str]:
    """`argv` of the train subcommand without its `--nproc N` / `--nproc=N`."""
    out: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--nproc":
            skip_next = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


ERROR_DIR_ENV = launch.ERROR_DIR_ENV
"""Set by `relaunch_with_torchrun` for its ranks: a rank's user error goes to a file there, not stderr."""


def relaunch_with_torchrun(nproc: int, command_name: str, train_argv: Sequence[str]) -> int:
    """Run `zeroinf <command_name>` as `nproc` ranks on this machine; returns the exit code.

    A user error in the ranks (the same on each, typically: a missing data file, a bad checkpoint)
    ends as one line and status 2, as in one process: each rank writes its line to a file
    (`ERROR_DIR_ENV`) and this process prints the distinct ones once the ranks are stopped, where
    torchrun printed every rank's line, then its own traceback and failure table (zeroinf/launch.py).
    Any other failure keeps the ranks' tracebacks and torchrun's report."""
    import shutil
    import tempfile

    check_ranks_fit(nproc)
    command = [
        sys.executable,
        "-m",
        "zeroinf.launch",  # torch.distributed.run, quiet when the ranks failed on a user error
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "zeroinf",
        command_name,
        *without_nproc(train_argv),
    ]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])  # so the ranks import this very zeroinf
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, available_cores() // nproc)))
    errors = tempfile.mkdtemp(prefix="zeroinf-rank-errors-")
    env[ERROR_DIR_ENV] = errors
    try:
        code = subprocess.run(command, env=env, check=False).returncode
        lines = []
        for name in sorted(os.listdir(errors)):
            with open(os.path.join(errors, name)) as f:
                lines.append(f.read().strip())
        for line in dict.fromkeys(lines):  # once each: every rank usually meets the same error
            print(line, file=sys.stderr)
        return 2 if lines else code
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def run_bench_io(rest: Sequence[str]) -> int:
    from zeroinf.aio.bench import add_arguments, run  # lazily: `train` works without the aio package

    parser = Parser(prog="zeroinf bench-io", description="Measure NVMe read/write bandwidth.")
    add_arguments(parser)
    result = run(parser.parse_args(list(rest)))
    return int(result) if isinstance(result, int) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="zeroinf", description="ZeRO-sharded training for PyTorch.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_arguments(
        sub.add_parser("train", help="train the demo GPT (byte-level) on a text corpus", allow_abbrev=False)
    )
    add_finetune_arguments(
        sub.add_parser(
            "finetune", help="fine-tune a Hugging Face model folder on text (LoRA or full)", allow_abbrev=False
        )
    )
    bench = sub.add_parser("bench-io", help="measure NVMe read/write bandwidth", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    from zeroinf.checkpoint.consolidate import add_arguments as add_consolidate_arguments
    from zeroinf.planner.command import add_arguments as add_plan_arguments

    add_plan_arguments(
        sub.add_parser(
            "plan", help="estimate memory per tier and step time of every placement, before the run",
            allow_abbrev=False,
        )
    )

    add_consolidate_arguments(
        sub.add_parser("consolidate", help="write a checkpoint's full weights as safetensors", allow_abbrev=False)
    )
    from zeroinf.env_report import add_arguments as add_env_arguments

    add_env_arguments(
        sub.add_parser(
            "env", help="versions, devices, CPU, memory limits and the NVMe folder: for a bug report",
            allow_abbrev=False,
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeroinf` and `python -m zeroinf`; returns the exit code (2: the user's error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_cli_logging()
    prog = f"zeroinf {argv[0]}" if argv and not argv[0].startswith("-") else "zeroinf"
    try:
        return run_command(argv)
    except USER_ERRORS as error:
        line = f"{prog}: error: {one_line(error)}"
        folder = os.environ.get(ERROR_DIR_ENV)
        if folder and "RANK" in os.environ:  # a rank of `relaunch_with_torchrun`: it prints the line
            with open(os.path.join(folder, f"rank{int(os.environ['RANK']):05d}"), "w") as f:
                f.write(line)
        else:
            print(line, file=sys.stderr)
        return 2
    finally:
        leave_process_group()


def leave_process_group() -> None:
    """A rank leaves its process group before the interpreter exits, on success and on error: left
    to the interpreter's shutdown, gloo's threads were torn down with it half gone while the other
    ranks closed their sockets, and a rank aborted with "terminate called without an active
    exception" (1 run in 16 of a two-rank run stopping on a missing checkpoint, with another such
    run beside it; topology.py [Note: a process group that outlives destroy_process_group]). Leaving
    at once is safe because `init_distributed` returns only once every rank is connected."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_command(argv: list[str]) -> int:
    """Parse `argv` and run its subcommand; errors propagate to `main`."""
    if argv and argv[0] == "bench-io":
        return run_bench_io(argv[1:])
    ns = build_parser().parse_args(argv)
    if ns.command == "consolidate":
        from zeroinf.checkpoint.consolidate import run as run_consolidate

        return run_consolidate(ns)
    if ns.command == "plan":
        from zeroinf.planner.command import run as run_plan

        return run_plan(ns)
    if ns.command == "env":
        from zeroinf.env_report import run as run_env

        return run_env(ns)
    if ns.command == "finetune":
        return run_finetune(ns, argv[1:])
    return run_train(ns, argv[1:])


def one_line(error: BaseException) -> str:
    """The error's message on one line (its type's name if it has none)."""
    return " ".join(str(error).split()) or type(error).__name__
