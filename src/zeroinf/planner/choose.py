"""Candidate placements and `auto`: every concrete Config a partly-"auto" Config allows, and the pick.

A placement is a stage, a tier for each of params / optimizer / gradients, and activation
checkpointing on or off. The fields of the user's Config that are "auto" span the candidates; the
others stay as given. Combinations the engine refuses (parameters off the device below stage 3,
gradient shards before stage 2, offloaded gradients with the optimizer on the device) are not
candidates. The pick (`choose`) is the fastest predicted placement that fits; ties go to the one
that moves the fewest bytes, then to the simpler one (lower stage, no checkpointing).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from zeroinf.config import AUTO, TIERS, Config, ConfigError
from zeroinf.planner.estimate import Estimate

STAGES = (0, 1, 2, 3)


def candidates(base: Config, nvme_dir: str | None, refused: list[str] | None = None) -> list[Config]:
    """The concrete Configs `base` allows, in a stable order (stage, tiers, checkpointing); why each
    combination left out was refused goes to `refused` (once per reason), so that "no candidate"
    can say which fixed fields rule everything out."""
    o = base.offload
    # A field that is not "auto" is its own only candidate (Config checked it: a stage number, true or false).
    stages = (base.stage,) if isinstance(base.stage, int) else STAGES
    pick = {
        name: TIERS if getattr(o, name) == AUTO else (getattr(o, name),)
        for name in ("params", "optimizer", "gradients")
    }
    given_ckpt = base.activation_checkpointing
    ckpt = (given_ckpt,) if isinstance(given_ckpt, bool) else (False, True)
    out = []
    for stage, params, optimizer, gradients, checkpointing in itertools.product(
        stages, pick["params"], pick["optimizer"], pick["gradients"], ckpt
    ):
        uses_nvme = "nvme" in (params, optimizer, gradients)
        if uses_nvme and nvme_dir is None and o.nvme_dir is None:
            _note(refused, "an NVMe placement needs an NVMe folder")
            continue
        try:  # the offload table alone may refuse a combination (a parameter cache without NVMe parameters)
            offload = dataclasses.replace(
                o, params=params, optimizer=optimizer, gradients=gradients, nvme_dir=o.nvme_dir or nvme_dir
            )
            cfg = dataclasses.replace(
                base, stage=stage, offload=offload, activation_checkpointing=checkpointing,
                offload_activations=base.offload_activations and checkpointing,
            )
        except ConfigError as error:
            _note(refused, str(error))  # a combination the engine refuses
            continue
        out.append(cfg)
    return out


def _note(refused: list[str] | None, reason: str) -> None:
    if refused is not None and reason not in refused:
        refused.append(reason)


def _rank(e: Estimate) -> tuple[float, int, int, bool]:
    t = e.time
    moved = t.nvme_read_bytes + t.nvme_written_bytes
    return (round(t.step_s, 3), moved, e.config.resolved_stage, bool(e.config.activation_checkpointing))


def choose(estimates: Sequence[Estimate]) -> Estimate | None:
    """The fastest predicted placement that fits, or None when none does."""
    fitting = [e for e in estimates if e.fits]
    return min(fitting, key=_rank) if fitting else None


def ordered(estimates: Sequence[Estimate]) -> list[Estimate]:
    """Fitting placements first, fastest first; then the others, closest to fitting first."""
    fitting = sorted((e for e in estimates if e.fits), key=_rank)
    return fitting + sorted((e for e in estimates if not e.fits), key=lambda e: (e.pressure, _rank(e)))
