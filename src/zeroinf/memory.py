"""The ledger: per-tier accounting of the bytes the engine holds.

Every allocation of engine memory (flat buffers, shards, optimizer states, I/O buffers, swap files)
is reserved here and released when freed, so the live and peak bytes of each tier are measured
figures that tests assert and the estimator predicts. The ledger counts what the engine owns; it
does not see the user's activations or PyTorch's allocator caches.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum


class Tier(str, Enum):  # noqa: UP042 - str() and format() stay as they are
    """Where a piece of state lives."""

    DEVICE = "device"  # the accelerator, or the CPU when there is none
    HOST = "host"  # CPU RAM (pinned when CUDA is present)
    NVME = "nvme"  # a file on local disk


@dataclass
class TierUsage:
    live_bytes: int = 0
    peak_bytes: int = 0
    by_tag: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class Ledger:
    """Thread-safe live/peak byte counters per tier, broken down by tag (e.g. "param_shard").

    I/O workers reserve and release from their own threads, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[Tier, TierUsage] = {tier: TierUsage() for tier in Tier}

    def reserve(self, tier: Tier | str, nbytes: int, tag: str) -> None:
        if nbytes < 0:
            raise ValueError(f"ledger: cannot reserve a negative byte count ({nbytes}) for {tag!r}")
        usage = self._usage[Tier(tier)]
        with self._lock:
            usage.live_bytes += nbytes
            usage.by_tag[tag] += nbytes
            usage.peak_bytes = max(usage.peak_bytes, usage.live_bytes)

    def release(self, tier: Tier | str, nbytes: int, tag: str) -> None:
        if nbytes < 0:
            raise ValueError(f"ledger: cannot release a negative byte count ({nbytes}) for {tag!r}")
        usage = self._usage[Tier(tier)]
        with self._lock:
            if usage.by_tag[tag] < nbytes:
                raise RuntimeError(
                    f"ledger: releasing {nbytes} bytes of {tag!r} on {Tier(tier).value} "
                    f"but only {usage.by_tag[tag]} are reserved (double free?)"
                )
            usage.live_bytes -= nbytes
            usage.by_tag[tag] -= nbytes

    def live_bytes(self, tier: Tier | str, tag: str | None = None) -> int:
        usage = self._usage[Tier(tier)]
        with self._lock:
            return usage.live_bytes if tag is None else usage.by_tag.get(tag, 0)

    def peak_bytes(self, tier: Tier | str) -> int:
        with self._lock:
            return self._usage[Tier(tier)].peak_bytes

    def reset_peak(self) -> None:
        """Start a new peak window (e.g. per step) at the current live bytes."""
        with self._lock:
            for usage in self._usage.values():
                usage.peak_bytes = usage.live_bytes

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Plain-data view: {tier: {"live_bytes", "peak_bytes", "by_tag"}}."""
        with self._lock:
            return {
                tier.value: {
                    "live_bytes": u.live_bytes,
                    "peak_bytes": u.peak_bytes,
                    "by_tag": {k: v for k, v in u.by_tag.items() if v},
                }
                for tier, u in self._usage.items()
            }


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


# SSD endurance is rated in terabytes written (TBW); consumer NVMe drives are typically rated for a few
# hundred TB per TB of capacity (e.g. 600 TBW for 1 TB), datacenter ones for several thousand.
WEAR_STEPS = 10_000


def format_decimal_bytes(nbytes: float) -> str:
    """Decimal size, as drives are sold and rated: 1.5e9 -> '1.50 GB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes:.0f} B"


def ssd_wear(written_per_step: float) -> str:
    """NVMe writes of one step and of WEAR_STEPS steps."""
    return (
        f"{format_decimal_bytes(written_per_step)} written a step, "
        f"{format_decimal_bytes(written_per_step * WEAR_STEPS)} per {WEAR_STEPS:,} steps "
        "(SSD wear: compare with the drive's rated TBW; a 1 TB consumer drive is often rated for about 600 TB)"
    )


def parse_bytes(text: str, what: str = "byte size") -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, '1048576' -> 1048576.

    The one parser of byte sizes (config fields, `bench-io`, `consolidate --max-shard-size`); a bad
    `text` raises ValueError naming `what` (e.g. the option) and the accepted forms."""
    units = {
        "": 1, "b": 1,
        "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
        "t": 1000**4, "tb": 1000**4,
        "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    }
    s = text.strip().lower().replace("_", "")
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, suffix = s[:i].strip(), s[i:]
    error = f"cannot parse {what} {text!r}: use e.g. 4GiB, 512MiB, 1MB or a plain integer"
    if suffix not in units or not number or number.startswith("-"):
        raise ValueError(error)
    try:
        return int(float(number) * units[suffix])
    except (ValueError, OverflowError):
        raise ValueError(error) from None
