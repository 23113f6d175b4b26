"""report.md beside results.json: the comparison table, each scenario's diagnosis, and a chart of
throughput and where each step's time went."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from modules.utility import ACCURACY_PNG, LOSS_PNG, results_table, table_markdown

BREAKDOWN_PNG = "step_time_breakdown.png"
REPORT_MD = "report.md"


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def step_breakdown(row: dict[str, Any]) -> dict[str, float] | None:
    """Milliseconds per step waiting for data, copying to the device and computing."""
    step, wait, h2d = (_finite(row.get(k)) for k in ("avg_step_ms", "data_wait_frac", "h2d_frac"))
    if step is None or wait is None:
        return None
    h2d = h2d or 0.0
    return {"data wait": step * wait, "host-to-device": step * h2d,
            "compute": max(0.0, step * (1.0 - wait - h2d))}


def plot_breakdown(rows: list[dict[str, Any]], out_dir: Path) -> Path | None:
    """Two panels: samples/s per scenario, and each scenario's step time split by phase."""
    parts = {r["scenario"]: step_breakdown(r) for r in rows}
    parts = {k: v for k, v in parts.items() if v is not None}
    if not parts:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    rate_ax, step_ax = fig.subplots(1, 2)
    names = list(parts)
    rates = [_finite(next(r for r in rows if r["scenario"] == n).get("samples_per_s")) or 0.0
             for n in names]
    rate_ax.bar(names, rates, color="C0")
    rate_ax.set_title("Training throughput")
    rate_ax.set_ylabel("samples / s")
    for i, rate in enumerate(rates):
        rate_ax.annotate(f"{rate:.0f}", (i, rate), ha="center", va="bottom", fontsize="small")
    bottom = [0.0] * len(names)
    for j, phase in enumerate(("data wait", "host-to-device", "compute")):
        values = [parts[n][phase] for n in names]
        step_ax.bar(names, values, bottom=bottom, label=phase, color=f"C{j + 1}")
        bottom = [b + v for b, v in zip(bottom, values)]
    step_ax.set_title("Where each training step's time goes")
    step_ax.set_ylabel("ms per step")
    step_ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(out_dir) / BREAKDOWN_PNG
    fig.savefig(path)
    return path


def autotune_lines(report: dict[str, Any] | None) -> list[str]:
    """What the autotuner chose for each knob and the measurement behind it."""
    if not report:
        return []
    lines = [f"Autotune ({report.get('seconds', '?')} s of measuring on {report.get('device')}, "
             f"{report.get('compute_img_s')} img/s pure compute at the end"
             + (", reused on resume from " + report["reused_from"] if report.get("reused_from")
                else "") + "):", ""]
    for knob, entry in (report.get("knobs") or {}).items():
        choice = entry.get("choice")
        choice = str(choice).lower() if isinstance(choice, bool) else choice
        lines.append(f"- `{knob}` = {choice}: {entry.get('reason', '')}")
    return lines + [""]


def render_report(rows: list[dict[str, Any]], charts: list[str]) -> str:
    """The markdown text of report.md."""
    lines = ["# Training report", "", table_markdown(results_table(rows)), "",
             "Accuracies and data wait in percent; n/a = not measured on this hardware.", ""]
    lines += ["## Diagnosis", ""]
    for row in rows:
        diag = row.get("diagnosis") or {}
        settings = row.get("settings") or {}
        lines.append(f"### {row['scenario']}")
        lines.append("")
        lines.append(f"{settings.get('model', '?')} at {row.get('best_resolution')} px, batch "
                     f"{settings.get('batch_size')}, {settings.get('amp_dtype', 'fp32')} on "
                     f"{settings.get('device', '?')}.")
        lines.append("")
        lines.append(f"**{diag.get('bottleneck', 'not diagnosed')}**: {diag.get('summary', '')}")
        lines += [f"- {rec}" for rec in diag.get("recommendations", [])]
        lines.append("")
        lines += autotune_lines(row.get("autotune"))
    lines += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    lines += ["Open the scalars with `tensorboard --logdir runs` and, after a `--profile` run, the "
              "traces with `tensorboard --logdir profiler` (torch-tb-profiler plugin) or in "
              "Perfetto / chrome://tracing (`profiler/<scenario>/*.pt.trace.json`).", ""]
    return "\n".join(lines)


def write_report(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    charts = [name for name in (LOSS_PNG, ACCURACY_PNG) if (out_dir / name).exists()]
    breakdown = plot_breakdown(rows, out_dir)
    if breakdown is not None:
        charts.append(breakdown.name)
    path = out_dir / REPORT_MD
    path.write_text(render_report(rows, charts))
    return path
