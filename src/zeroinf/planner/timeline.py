"""One training step as a timeline a person can look at: self-contained HTML (inline SVG) and a
Chrome trace, with the step's time split by phase and the planner's prediction beside it.

The events come from `zeroinf.telemetry.record_phases()` (the labels of [Note: phase labels]):
forward, backward, unshard / reshard / reduce (collectives), swap_in / swap_out and wait_io.<kind>
(NVMe), optimizer. On each thread the phases nest; the time of a phase minus the phases inside it
(its exclusive time) goes to its category, and the step's time no phase covers is "other" (the
loss, data, Python between passes). `zeroinf train --report FILE` writes `FILE` (JSON) and, next
to it, `<stem>.timeline.html` and `<stem>.trace.json` (open in https://ui.perfetto.dev or
chrome://tracing).
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zeroinf.telemetry import PhaseEvent

CATEGORIES = ("compute", "collectives", "nvme I/O", "optimizer", "other")
COLORS = {
    "compute": "#4e79a7", "collectives": "#f28e2b", "nvme I/O": "#e15759", "optimizer": "#59a14f", "other": "#bab0ac",
}


def category(name: str) -> str:
    """The step-time category of a phase label (as the planner splits its prediction)."""
    phase = name.removeprefix("zeroinf::")
    if phase in ("forward", "backward"):
        return "compute"
    if phase in ("unshard", "reshard", "reduce"):
        return "collectives"
    if phase.startswith(("wait_io", "swap_")):
        return "nvme I/O"
    if phase.startswith("optimizer"):
        return "optimizer"
    return "other"


def exclusive_seconds(events: Sequence[PhaseEvent], thread: str) -> dict[str, float]:
    """Seconds per category on `thread`: each phase's duration minus the phases nested inside it."""
    own = sorted((e for e in events if e.thread == thread), key=lambda e: (e.start_s, -e.end_s))
    out: dict[str, float] = defaultdict(float)
    stack: list[tuple[PhaseEvent, list[float]]] = []  # (event, [seconds of its direct children])

    def close(until: float) -> None:
        while stack and stack[-1][0].end_s <= until:
            event, children = stack.pop()
            duration = event.end_s - event.start_s
            out[category(event.name)] += max(0.0, duration - children[0])
            if stack:
                stack[-1][1][0] += duration

    for event in own:
        close(event.start_s)
        stack.append((event, [0.0]))
    close(float("inf"))
    return dict(out)


def measured_split(events: Sequence[PhaseEvent], start_s: float, end_s: float, thread: str) -> dict[str, float]:
    """The step's wall time split into the planner's categories, from the training thread's phases."""
    split = {c: 0.0 for c in CATEGORIES}
    split.update(exclusive_seconds(events, thread))
    covered = sum(v for k, v in split.items() if k != "other")
    split["other"] = max(0.0, (end_s - start_s) - covered)
    split["step"] = end_s - start_s
    return split


def chrome_trace(events: Sequence[PhaseEvent], origin_s: float, rank: int = 0) -> dict[str, Any]:
    """Chrome trace format: one complete ("X") event per phase, microseconds from the step's start."""
    threads = {t: i for i, t in enumerate(dict.fromkeys(e.thread for e in events))}
    trace = [
        {"name": e.name, "cat": category(e.name), "ph": "X", "ts": (e.start_s - origin_s) * 1e6,
         "dur": (e.end_s - e.start_s) * 1e6, "pid": rank, "tid": threads[e.thread]}
        for e in events
    ]
    trace += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": i, "args": {"name": t}} for t, i in threads.items()
    ]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _svg(events: Sequence[PhaseEvent], start_s: float, end_s: float, main_thread: str) -> str:
    width, left, right, row_h = 1100, 150, 40, 18  # right: room for the last tick's label
    span = max(end_s - start_s, 1e-9)
    threads = sorted({e.thread for e in events}, key=lambda t: (t != main_thread, t))
    rows: list[tuple[str, int]] = []  # (thread, depth)
    for t in threads:
        depth = max((e.depth for e in events if e.thread == t), default=0)
        rows += [(t, d) for d in range(depth + 1)]
    row_of = {r: i for i, r in enumerate(rows)}
    height = 30 + row_h * len(rows) + 30
    scale = (width - left - right) / span
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11">']
    for (thread, depth), i in row_of.items():
        y = 30 + i * row_h
        if depth == 0:
            label = "training thread" if thread == main_thread else thread
            parts.append(f'<text x="4" y="{y + 13}">{html.escape(label[:22])}</text>')
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y + row_h}" y2="{y + row_h}" stroke="#eee"/>')
    ticks = 10
    for k in range(ticks + 1):
        x = left + k * (width - left - right) / ticks
        ms = span * 1e3 * k / ticks
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="22" y2="{height - 25}" stroke="#ddd"/>')
        parts.append(f'<text x="{x:.1f}" y="16" text-anchor="middle">{ms:.0f} ms</text>')
    for e in events:
        row = row_of.get((e.thread, e.depth))
        if row is None:
            continue
        x = left + (max(e.start_s, start_s) - start_s) * scale
        w = max(0.5, (min(e.end_s, end_s) - max(e.start_s, start_s)) * scale)
        y = 30 + row * row_h + 2
        name = e.name.removeprefix("zeroinf::")
        tip = f"{name}: {(e.end_s - e.start_s) * 1e3:.2f} ms at {(e.start_s - start_s) * 1e3:.1f} ms"
        parts.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 4}" fill="{COLORS[category(e.name)]}" '
            f'stroke="white" stroke-width="0.3"><title>{html.escape(tip)}</title></rect>'
        )
        if w > 7 * len(name):
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 11}" fill="white">{html.escape(name)}</text>')
    x = left
    for cat, color in COLORS.items():
        parts.append(f'<rect x="{x}" y="{height - 18}" width="12" height="12" fill="{color}"/>')
        parts.append(f'<text x="{x + 16}" y="{height - 8}">{html.escape(cat)}</text>')
        x += 110
    parts.append("</svg>")
    return "\n".join(parts)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(pred: float | None, meas: float | None) -> str:
    if pred is None or not meas:
        return "-"
    return f"{pred / meas - 1:+.0%}"


def timeline_html(
    events: Sequence[PhaseEvent],
    start_s: float,
    end_s: float,
    main_thread: str,
    title: str,
    predicted: dict[str, Any] | None = None,
    measured_bytes: dict[str, int] | None = None,
    facts: Sequence[str] = (),
) -> str:
    """The page: what ran, the timeline, and a table of predicted vs measured time and bytes."""
    split = measured_split(events, start_s, end_s, main_thread)
    rows = []
    pred_time = (predicted or {}).get("time", {})
    keys = {"compute": "compute_s", "collectives": "collectives_s", "nvme I/O": "nvme_io_s",
            "optimizer": "optimizer_s", "step": "step_s"}
    for cat in (*CATEGORIES, "step"):
        p = pred_time.get(keys[cat]) if cat in keys else None
        m = split.get(cat, 0.0)
        rows.append(
            f"<tr><td>{html.escape(cat)}</td><td>{m * 1e3:,.1f}</td>"
            f"<td>{'-' if p is None else f'{p * 1e3:,.1f}'}</td><td>{_ratio(p, m)}</td></tr>"
        )
    byte_rows = []
    pred_bytes = (predicted or {}).get("peak_bytes", {})
    for tier in ("device", "host", "nvme"):
        m_bytes = (measured_bytes or {}).get(tier)
        p = pred_bytes.get(tier)
        byte_rows.append(
            f"<tr><td>{tier}</td><td>{_fmt_bytes(m_bytes)}</td><td>{_fmt_bytes(p)}</td>"
            f"<td>{_ratio(p, m_bytes)}</td></tr>"
        )
    notes = "".join(f"<li>{html.escape(f)}</li>" for f in facts)
    time_note = (
        "Measured: exclusive time of the training thread's phases (a phase minus the phases inside it); "
        "NVMe I/O counts the waits and request issue on the training thread, not transfers hidden behind "
        "compute. Predicted: <code>zeroinf.plan</code> for this placement (the prediction's parts overlap, "
        "so they need not add up to the step)."
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:20px;color:#222}} table{{border-collapse:collapse;margin:8px 0 18px}}
td,th{{border:1px solid #ccc;padding:3px 10px;text-align:right}} td:first-child,th:first-child{{text-align:left}}
.wrap{{overflow-x:auto}}</style></head>
<body><h2>{html.escape(title)}</h2><ul>{notes}</ul>
<div class="wrap">{_svg(events, start_s, end_s, main_thread)}</div>
<h3>Step time, ms</h3>
<table><tr><th>part</th><th>measured</th><th>predicted</th><th>error</th></tr>{"".join(rows)}</table>
<p style="max-width:900px;font-size:90%">{time_note}</p>
<h3>Peak bytes per rank (engine ledger)</h3>
<table><tr><th>tier</th><th>measured</th><th>predicted</th><th>error</th></tr>{"".join(byte_rows)}</table>
</body></html>
"""


def write_step_report(
    stem: Path,
    events: Sequence[PhaseEvent],
    start_s: float,
    end_s: float,
    main_thread: str,
    title: str,
    predicted: dict[str, Any] | None = None,
    measured_bytes: dict[str, int] | None = None,
    facts: Sequence[str] = (),
    rank: int = 0,
) -> dict[str, Any]:
    """Write `<stem>.timeline.html` and `<stem>.trace.json`; return the measured split and the paths."""
    stem = Path(stem)
    html_path = stem.with_name(stem.name + ".timeline.html")
    trace_path = stem.with_name(stem.name + ".trace.json")
    inside = [e for e in events if e.end_s >= start_s and e.start_s <= end_s]
    html_path.write_text(timeline_html(inside, start_s, end_s, main_thread, title, predicted, measured_bytes, facts))
    trace_path.write_text(json.dumps(chrome_trace(inside, start_s, rank)))
    return {
        "measured_s": measured_split(inside, start_s, end_s, main_thread),
        "measured_bytes": dict(measured_bytes or {}),
        "timeline_html": str(html_path),
        "trace_json": str(trace_path),
        "events": len(inside),
    }


def write_run_timeline(
    model: Any,
    model_facts: Callable[[], Any],
    tokens_per_step: int,
    seq_len: int,
    timeline: dict[str, Any],
    report_path: str | None,
    title: str,
    facts: Sequence[str],
    rank: int,
) -> dict[str, Any]:
    """The recorded step of `zeroinf train`/`finetune` (`timeline`: recorder, ledger, step) beside the
    report, with the plan's prediction from the unit plan the engine built; `model_facts()` gives
    the model's facts (a forward on meta tensors; it may fail, and the timeline is written alone)."""
    import zeroinf
    from zeroinf.planner.api import predict_built
    from zeroinf.planner.report import estimate_json

    predicted: dict[str, Any]
    try:
        estimate = predict_built(zeroinf.engine_of(model), model_facts(), tokens_per_step, seq_len)
        predicted = estimate_json(estimate)
    except (ValueError, RuntimeError, ImportError) as exc:  # the planner cannot estimate it
        predicted = {"error": str(exc)}
    recorder = timeline["recorder"]
    ledger = timeline["ledger"] or {}
    stem = Path(report_path or "report")
    stem = stem.with_suffix("") if stem.suffix else stem
    out = write_step_report(
        stem, recorder.events, recorder.start_s, recorder.end_s or recorder.start_s, "MainThread", title,
        predicted=predicted if "error" not in predicted else None,
        measured_bytes={t: ledger[t]["peak_bytes"] for t in ("device", "host", "nvme") if t in ledger},
        facts=facts,
        rank=rank,
    )
    out["predicted"] = predicted
    return out
