"""A plan for people (a table and a few sentences) and for programs (plain JSON)."""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroinf.memory import format_bytes, ssd_wear
from zeroinf.planner.estimate import Estimate


def _short(e: Estimate) -> str:
    c = e.config
    o = c.offload
    ckpt = "yes" if c.activation_checkpointing else "no"
    optimizer = "split" if e.optimizer_split is not None else o.optimizer  # host + nvme by max_host_bytes
    params = "split" if e.param_split is not None else o.params
    return f"{c.stage}  {params:<6} {optimizer:<6} {o.gradients:<6} {ckpt:<4}"


def _mib(n: float) -> str:
    return format_bytes(n).replace(" ", "")


def format_estimate(e: Estimate) -> str:
    """One line: where the bytes go and how long a step takes."""
    t = e.time
    return (
        f"{e.placement}: {t.step_s:.2f} s/step (compute {t.compute_s:.2f}, collectives {t.collectives_s:.2f}, "
        f"nvme I/O {t.nvme_io_s:.2f}, optimizer {t.optimizer_s:.2f}; bound by {t.bound}); per rank: device "
        f"{_mib(e.ledger.device)}, host {_mib(e.ledger.host)}, nvme {_mib(e.ledger.nvme)}, process {_mib(e.ram_bytes)}"
    )


def summary(plan: Any) -> list[str]:
    """What this machine can do with the model, in a few sentences."""
    w = plan.workload
    lines = [
        f"{plan.model}: {plan.param_count / 1e9:.3g}B parameters; {plan.workload.world_size} rank(s), "
        f"{w.tokens_per_step} tokens/step (micro-batch {w.micro_batch} x {w.seq_len} per rank), "
        f"{plan.estimates[0].config.param_dtype if plan.estimates else '?'} compute"
        + (", bf16 Adam moments" if plan.estimates and plan.estimates[0].config.offload.moment_dtype == "bf16" else ""),
        f"machine: {plan.profile.cpu}, {plan.profile.cores} cores, device {plan.profile.device}, "
        f"{'native' if plan.profile.bf16_native else 'no native'} bf16; per rank {_mib(plan.capacity.ram_bytes)} RAM "
        "available"
        + (
            f", {_mib(plan.capacity.nvme_free_bytes)} free in {plan.nvme_dir}"
            if plan.capacity.nvme_free_bytes is not None
            else ""
        ),
    ]
    fitting = [e for e in plan.estimates if e.fits]
    if plan.best is not None:
        best = plan.best
        lines.append(
            f"fastest that fits ({len(fitting)} of {len(plan.estimates)} placements fit): {format_estimate(best)}; "
            f"{w.tokens_per_step / best.time.step_s:,.0f} tokens/s"
        )
        if best.time.nvme_written_bytes:
            lines.append(f"nvme per rank in that placement: {ssd_wear(best.time.nvme_written_bytes)}")
    elif plan.estimates:
        least = plan.estimates[0]  # the closest to fitting
        lines.append(
            f"nothing fits: the closest is {least.placement}, which needs {'; '.join(least.why_not)}. "
            f"Were it to fit: {least.time.step_s:,.0f} s/step ({w.tokens_per_step / least.time.step_s:,.1f} tokens/s, "
            f"bound by {least.time.bound})"
        )
        if least.pressure > 1 and least.pressure != float("inf"):
            lines.append(
                f"this machine holds about {plan.param_count / least.pressure / 1e9:.2g}B parameters of this shape "
                f"in that placement ({plan.workload.world_size} rank(s)); more ranks, RAM or NVMe space fit more"
            )
    else:
        lines.append("no candidate placement (an NVMe placement needs an NVMe folder)")
    return lines + [f"note: {n}" for n in plan.notes]


def format_plan(plan: Any, limit: int | None = 12) -> str:
    header = (
        f"{'st':<3}{'params':<7}{'optim':<7}{'grads':<7}{'ckpt':<5}| {'device':>9} {'host':>9} {'nvme':>9} "
        f"{'process':>9} | {'fits':<5}| {'step s':>8} {'compute':>8} {'coll':>7} {'nvme io':>8} {'optim':>7} | bound"
    )
    rows = [header, "-" * len(header)]
    shown = plan.estimates if limit is None else plan.estimates[:limit]
    for e in shown:
        t = e.time
        mark = "*" if e is plan.best else " "
        rows.append(
            f"{_short(e)}| {_mib(e.ledger.device):>9} {_mib(e.ledger.host):>9} {_mib(e.ledger.nvme):>9} "
            f"{_mib(e.ram_bytes):>9} | {('yes' + mark) if e.fits else 'no':<5}| {t.step_s:8.2f} {t.compute_s:8.2f} "
            f"{t.collectives_s:7.2f} {t.nvme_io_s:8.2f} {t.optimizer_s:7.2f} | {t.bound}"
            + ("" if e.fits else f" ({'; '.join(e.why_not)})")
        )
    if len(shown) < len(plan.estimates):
        rows.append(f"... {len(plan.estimates) - len(shown)} more (--all)")
    rows.append("bytes are peaks per rank; process = the rank's peak RSS (device tier included on a CPU-only machine)")
    return "\n".join(summary(plan) + [""] + rows)


def estimate_json(e: Estimate) -> dict[str, Any]:
    return {
        "placement": {
            "stage": e.config.stage, "params": e.config.offload.params, "optimizer": e.config.offload.optimizer,
            "gradients": e.config.offload.gradients, "activation_checkpointing": e.config.activation_checkpointing,
            "param_dtype": e.config.param_dtype,
        },
        "optimizer_split": None if e.optimizer_split is None else e.optimizer_split.to_json(),
        "param_split": None if e.param_split is None else {"host_units": e.param_split[0],
                                                            "nvme_units": e.param_split[1]},
        "peak_bytes": {"device": e.ledger.device, "host": e.ledger.host, "nvme": e.ledger.nvme},
        "peak_bytes_by_tag": e.ledger.by_tag,
        "activation_bytes": e.activation_bytes,
        "process_peak_bytes": e.ram_bytes,
        "device_memory_bytes": e.device_bytes,
        "fits": e.fits,
        "why_not": list(e.why_not),
        "time": dataclasses.asdict(e.time),
    }


def plan_json(plan: Any) -> dict[str, Any]:
    return {
        "model": plan.model,
        "param_count": plan.param_count,
        "workload": dataclasses.asdict(plan.workload) | {"micro_batch": plan.workload.micro_batch},
        "machine": {k: v for k, v in plan.profile.to_json().items() if k != "matmul_flops"},
        "capacity": dataclasses.asdict(plan.capacity),
        "nvme_dir": plan.nvme_dir,
        "best": estimate_json(plan.best) if plan.best is not None else None,
        "candidates": [estimate_json(e) for e in plan.estimates],
        "summary": summary(plan),
        "notes": plan.notes,
    }
