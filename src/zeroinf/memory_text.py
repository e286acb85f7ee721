"""`zeroinf.memory_report(model)` as people read it: a dict, printed as a short table.

The report is a plain dict for programs (JSON, dashboards, tests); `print(report)` showed that
dict on one line of several hundred characters. `MemoryReport` is the same dict whose `str()` is a
few lines: live and peak bytes per tier with bytes per parameter and the largest tags, then the last
step's NVMe traffic, the host<->device copies and the collectives.
"""

from __future__ import annotations

from typing import Any

from zeroinf.memory import format_bytes

TIERS = ("device", "host", "nvme")


class MemoryReport(dict[str, Any]):
    """The dict `memory_report()` returns; `str()` renders it for reading (`print(report)`)."""

    def __str__(self) -> str:
        return render(self)


def _tags(by_tag: dict[str, float], shown: int = 4) -> str:
    ranked = sorted(((v, k) for k, v in by_tag.items() if v), reverse=True)
    text = ", ".join(f"{k} {format_bytes(v)}" for v, k in ranked[:shown])
    return text + (f", +{len(ranked) - shown} more" if len(ranked) > shown else "")


def render(report: dict[str, Any]) -> str:
    lines = [f"{'zeroinf memory (this rank)':<28}{'live':>11}{'peak':>11}{'peak B/param':>14}"]
    for tier in TIERS:
        usage = report.get(tier) or {}
        lines.append(
            f"  {tier:<26}{format_bytes(usage.get('live_bytes', 0)):>11}{format_bytes(usage.get('peak_bytes', 0)):>11}"
            f"{usage.get('peak_bytes_per_param', 0.0):>14.2f}"
        )
        if usage.get("by_tag"):
            lines.append(f"    {_tags(usage['by_tag'])}")
    io = report.get("io") or {}
    step = io.get("last_step") or {}
    if step:
        lines.append(
            f"  last step {step.get('step_s', 0.0):.2f} s: NVMe read {format_bytes(step.get('read_bytes', 0))}, "
            f"written {format_bytes(step.get('written_bytes', 0))} ({step.get('bytes_per_param', 0.0):.1f} B/param), "
            f"disk busy {100 * step.get('disk_busy_share', 0.0):.0f}% of the step, "
            f"{io.get('overlap_pct', 0.0):.0f}% of I/O hidden"
        )
    copies = (report.get("transfers") or {}).get("last_step") or {}
    if copies.get("h2d_copies") or copies.get("d2h_copies"):
        lines.append(
            f"  copies last step: to device {format_bytes(copies['h2d_bytes'])} in {copies['h2d_copies']}, "
            f"to host {format_bytes(copies['d2h_bytes'])} in {copies['d2h_copies']}; pageable "
            f"{copies.get('pageable_copies', 0)}, stalls {copies.get('stalls', 0)}"
        )
    collectives = report.get("collectives_last_step") or {}
    if collectives:
        lines.append("  collectives last step: " + ", ".join(f"{k} {v}" for k, v in sorted(collectives.items())))
    lines.append(
        f"  units {report.get('units', 0)} ({report.get('resident_units', 0)} resident, "
        f"{report.get('frozen_units', 0)} frozen)"
    )
    return "\n".join(lines)
