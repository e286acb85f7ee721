"""`zeroinf plan`: every placement of a model on this machine, estimated before the run.

    zeroinf plan --model 125m --world 2 --tokens 16384        # a demo preset
    zeroinf plan --hf path/to/model-folder                     # a Hugging Face config.json, no weights read
    zeroinf plan --measure --nvme-dir /nvme/tmp                # probe this machine first (under a minute), cached
    zeroinf plan --hf ... --json                               # for programs

Fields left out are "auto" (the stage, the three tiers, activation checkpointing, the dtype); give
`--stage 3` or `--offload-params nvme` to fix one. The best placement is marked with `*`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from zeroinf.config import AUTO, DTYPES, Config, OffloadConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zeroinf.models.gpt import PRESETS

    model = parser.add_argument_group("model (one of)")
    source = model.add_mutually_exclusive_group()
    source.add_argument("--model", choices=sorted(PRESETS), help="a demo GPT preset (default: small)")
    source.add_argument("--hf", metavar="PATH", help="a Hugging Face model folder or its config.json (no weights read)")
    run = parser.add_argument_group("workload")
    run.add_argument("--world", type=int, default=1, metavar="N", help="data-parallel ranks (default: 1)")
    run.add_argument("--tokens", type=int, metavar="N", help="tokens per optimizer step over all ranks")
    run.add_argument("--batch", type=int, metavar="B", help="sequences per step over all ranks (instead of --tokens)")
    run.add_argument(
        "--seq-len", type=int, metavar="T", help="tokens per sequence (default: the model's context, at most 2048)"
    )
    run.add_argument("--grad-accum", type=int, default=1, metavar="N", help="micro-steps per optimizer step")
    run.add_argument(
        "--threads", type=int, metavar="N", help="CPU threads per rank (default: the cores shared by the ranks)"
    )
    engine = parser.add_argument_group("placement (left out: auto)")
    engine.add_argument(
        "--config", metavar="FILE",
        help='zeroinf config, .toml or .json: its fields as given, "auto" where it says so '
        "(without --config every placement field is auto)",
    )
    engine.add_argument("--stage", type=int, choices=(0, 1, 2, 3))
    engine.add_argument("--dtype", choices=[*sorted(DTYPES), AUTO], help="compute dtype (default: auto)")
    tiers = ("device", "host", "nvme", AUTO)
    engine.add_argument("--offload-params", choices=tiers)
    engine.add_argument("--offload-optimizer", choices=tiers)
    engine.add_argument("--offload-gradients", choices=tiers)
    engine.add_argument("--checkpointing", choices=("on", "off", AUTO), help="activation checkpointing")
    engine.add_argument("--nvme-dir", metavar="DIR", help="folder of the swap files (default: the temp folder)")
    engine.add_argument(
        "--optimizer", default="adamw", metavar="NAME",
        help="whose states to count beside the fp32 masters: adamw (default, 2 moments), lion, sgd_momentum, "
        "adagrad, rmsprop (1), sgd (none), ... or the number of state tensors (0, 1, 2)",
    )
    from zeroinf.cli import add_host_memory_arguments

    add_host_memory_arguments(engine)
    machine = parser.add_argument_group("machine and output")
    machine.add_argument(
        "--measure", action="store_true",
        help="probe this machine (matmul, memory, CPU Adam, disk at --nvme-dir, collectives at --world) and cache it",
    )
    machine.add_argument("--json", action="store_true", help="print one JSON object")
    machine.add_argument("--all", action="store_true", help="list every candidate placement")


def plan_config(ns: argparse.Namespace) -> Config:
    """The Config to plan: the file's fields (or all "auto"), with the options applied."""
    from zeroinf.planner.api import ALL_AUTO

    base = Config.load(ns.config) if ns.config else dataclasses.replace(ALL_AUTO, param_dtype=AUTO)
    changes: dict[str, object] = {}
    if ns.stage is not None:
        changes["stage"] = ns.stage
    if ns.dtype is not None:
        changes["param_dtype"] = ns.dtype
    if ns.checkpointing is not None:
        changes["activation_checkpointing"] = {"on": True, "off": False}.get(ns.checkpointing, AUTO)
    if ns.grad_accum != 1:
        changes["grad_accum_steps"] = ns.grad_accum
    tiers = {"params": ns.offload_params, "optimizer": ns.offload_optimizer, "gradients": ns.offload_gradients}
    offload = {**dataclasses.asdict(base.offload), **{k: v for k, v in tiers.items() if v is not None}}
    if ns.nvme_dir:
        offload["nvme_dir"] = ns.nvme_dir
    elif "nvme" in tiers.values() and not offload["nvme_dir"]:  # as for auto: the temp folder (--nvme-dir's help)
        import tempfile

        offload["nvme_dir"] = tempfile.gettempdir()
    if ns.max_host_bytes:
        offload["max_host_bytes"] = ns.max_host_bytes
    if ns.param_cache:
        offload["param_cache_bytes"] = ns.param_cache
    if ns.moment_dtype:
        offload["moment_dtype"] = ns.moment_dtype
    return dataclasses.replace(base, **changes, offload=OffloadConfig(**offload))  # type: ignore[arg-type]


def run(ns: argparse.Namespace) -> int:
    from zeroinf.planner import profile as profiles
    from zeroinf.planner.api import plan

    if ns.world < 1:
        raise ValueError(f"--world {ns.world} is invalid: use a positive number of ranks")
    for option, value in (("--tokens", ns.tokens), ("--batch", ns.batch), ("--seq-len", ns.seq_len),
                          ("--grad-accum", ns.grad_accum), ("--threads", ns.threads)):
        if value is not None and value < 1:
            raise ValueError(f"{option} {value} is invalid: use a positive number")
    cfg = plan_config(ns)
    profile = profiles.load_profile()
    if ns.measure:
        import tempfile

        folder = ns.nvme_dir or cfg.offload.nvme_dir or tempfile.gettempdir()
        t0 = time.perf_counter()
        log = (lambda s: None) if ns.json else (lambda s: print(f"measuring: {s}", file=sys.stderr, flush=True))
        measured = profiles.measure_profile(folder, (ns.world,), log=log)
        profile = profiles.merge_profiles(profile, measured) if profile.measured else measured
        path = profiles.save_profile(profile)
        if not ns.json:
            print(f"measured in {time.perf_counter() - t0:.0f} s, cached in {path}", file=sys.stderr)
    from zeroinf.planner.api import default_seq_len
    from zeroinf.planner.model_facts import from_hf, from_preset

    model = from_hf(ns.hf, cfg.unit_classes) if ns.hf else from_preset(ns.model or "small", cfg.unit_classes)
    seq_len = ns.seq_len
    tokens = ns.tokens
    if ns.batch is not None:  # sequences of --seq-len, or of its default (the model's context, at most 2048)
        seq_len = seq_len or default_seq_len(model)
        tokens = ns.batch * seq_len
    result = plan(
        model, cfg, world_size=ns.world, tokens_per_step=tokens, seq_len=seq_len,
        profile=profile, nvme_dir=ns.nvme_dir, threads=ns.threads,
        optimizer=int(ns.optimizer) if ns.optimizer.isdigit() else ns.optimizer,
    )
    if ns.json:
        print(json.dumps(result.to_json(), indent=1, default=str))
    else:
        print(result.table(limit=None if ns.all else 12))
    return 0
