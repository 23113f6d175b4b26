"""report.md beside results.json: the comparison table, each scenario's diagnosis, and a chart of
throughput and where each step's time went."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from modules.utility import (ACCURACY_PNG, LOSS_PNG, load_model, predict, results_table,
                             table_markdown)

BREAKDOWN_PNG = "step_time_breakdown.png"
CONFUSION_PNG = "confusion_matrix.png"
PREDICTIONS_PNG = "sample_predictions.png"
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
    fig = _figure(10, 4.5)
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


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row with the highest test accuracy (ties: the earlier scenario)."""
    scored = [r for r in rows if _finite(r.get("test_acc")) is not None]
    return max(scored, key=lambda r: r["test_acc"]) if scored else None


def plot_confusion(row: dict[str, Any], out_dir: Path) -> Path | None:
    """The scenario's test confusion matrix (counts, shaded by share of the true class) and
    its per-class accuracy. `row`: a results row, or a saved model's `meta["extra"]`."""
    matrix = row.get("confusion_matrix")
    per_class = row.get("per_class_test_acc") or {}
    if not matrix or not per_class:
        return None
    names = list(per_class)
    n = len(names)
    fig = _figure(4 + 0.9 * n, 1.5 + 0.55 * n)
    grid_ax, acc_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    shares = [[v / max(1, sum(line)) for v in line] for line in matrix]
    grid_ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    for i in range(n):
        for j in range(n):
            grid_ax.text(j, i, str(int(matrix[i][j])), ha="center", va="center", fontsize="small",
                         color="white" if shares[i][j] > 0.5 else "black")
    grid_ax.set_xticks(range(n), names, rotation=45, ha="right", fontsize="small")
    grid_ax.set_yticks(range(n), names, fontsize="small")
    grid_ax.set_xlabel("predicted")
    grid_ax.set_ylabel("true")
    grid_ax.set_title(f"{row['scenario']}: test confusion matrix")
    accs = [100 * (per_class[k] or 0.0) for k in names]
    acc_ax.barh(names, accs, color="C2")
    acc_ax.invert_yaxis()
    acc_ax.set_xlim(0, 112)
    acc_ax.set_xlabel("test accuracy (%)")
    acc_ax.set_title("per class")
    for i, acc in enumerate(accs):
        acc_ax.annotate(f"{acc:.0f}", (acc, i), va="center", fontsize="small")
    fig.tight_layout()
    path = Path(out_dir) / CONFUSION_PNG
    fig.savefig(path)
    return path


def plot_predictions(model_path: Path, samples: list[tuple[str, int]], class_names: list[str],
                     out_dir: Path, *, n: int = 16, seed: int = 0) -> Path | None:
    """A grid of `n` test images (a seeded draw) with the saved model's prediction, its
    probability and the true label; green when right, red when wrong."""
    if not samples or not Path(model_path).exists():
        return None
    import random
    from PIL import Image

    chosen = random.Random(seed).sample(samples, min(n, len(samples)))
    predictions = predict(load_model(model_path), [path for path, _ in chosen])
    cols = min(4, len(chosen))
    rows = math.ceil(len(chosen) / cols)
    fig = _figure(2.6 * cols, 2.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (path, label), pred in zip(axes.flat, chosen, predictions):
        with Image.open(path) as img:
            ax.imshow(img.convert("RGB"))
        truth = class_names[label]
        ax.set_title(f"{pred['label']} ({100 * pred['prob']:.0f}%)\ntrue: {truth}",
                     fontsize="small", color="green" if pred["label"] == truth else "red")
    fig.tight_layout()
    path = Path(out_dir) / PREDICTIONS_PNG
    fig.savefig(path)
    return path


def versus_baseline_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line a scenario: test accuracy with its standard error, the difference from the
    baseline, and the time it took, tuning included, against the baseline's."""
    lines = []
    for row in rows:
        acc, se = _finite(row.get("test_acc")), _finite(row.get("test_acc_se"))
        line = f"{row['scenario']}: test accuracy " + (
            "n/a" if acc is None else f"{100 * acc:.1f}%" + (f" +- {100 * se:.1f}" if se else ""))
        diff, ratio = _finite(row.get("test_acc_vs_baseline")), _finite(row.get("total_vs_baseline"))
        total = _finite(row.get("total_s"))
        if row["scenario"] != "baseline" and diff is not None:
            line += f", {diff:+.1f} points against the baseline"
        if total is not None:
            line += f", {total:.0f} s in all" + (
                f" ({ratio:.2f}x the baseline's)" if row["scenario"] != "baseline" and ratio
                else "")
        reached = row.get("time_to_baseline_acc_s")
        if row["scenario"] != "baseline" and row.get("baseline_acc_target") is not None:
            line += ("; reached the baseline's validation accuracy after "
                     f"{reached:.0f} s" if reached is not None
                     else "; never reached the baseline's validation accuracy")
        lines.append(line)
    return lines


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


def earlier_runs_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per earlier run in results.json: its id, dataset, scenarios and best test
    accuracy, newest first."""
    runs: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        runs.setdefault(row.get("run_id"), []).append(row)
    lines = []
    for run_id, members in sorted(runs.items(), key=lambda kv: str(kv[0]), reverse=True):
        best = best_row(members)
        lines.append(f"- {run_id or 'before run ids'}: {members[0].get('dataset')}, "
                     + ", ".join(r["scenario"] for r in members)
                     + (f"; best test accuracy {100 * best['test_acc']:.1f}% ({best['scenario']})"
                        if best else ""))
    return lines


def render_report(rows: list[dict[str, Any]], charts: list[str],
                  earlier: list[dict[str, Any]] | None = None) -> str:
    """The markdown text of report.md: this run's rows; earlier runs listed at the end."""
    run_id = rows[0].get("run_id") if rows else None
    lines = ["# Training report" + (f": run {run_id}" if run_id else ""), "",
             table_markdown(results_table(rows)), "",
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
              "Perfetto / chrome://tracing (`profiler/<run>/<scenario>/*.pt.trace.json`).", ""]
    if earlier:
        lines += ["## Earlier runs in this folder", "",
                  "Their rows stay in results.json; their checkpoints, scalars and traces in "
                  "checkpoints/, runs/ and profiler/ under the run's id.", ""]
        lines += earlier_runs_lines(earlier) + [""]
    return "\n".join(lines)


def write_report(rows: list[dict[str, Any]], out_dir: Path,
                 earlier: list[dict[str, Any]] | None = None) -> Path:
    out_dir = Path(out_dir)
    charts = [name for name in (LOSS_PNG, ACCURACY_PNG) if (out_dir / name).exists()]
    best = best_row(rows)
    for chart in (plot_breakdown(rows, out_dir), best and plot_confusion(best, out_dir)):
        if chart is not None:
            charts.append(chart.name)
    path = out_dir / REPORT_MD
    path.write_text(render_report(rows, charts, earlier))
    return path
