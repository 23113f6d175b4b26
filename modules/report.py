"""Reports: the results table, the charts (training curves, step-time breakdown, confusion
matrix, predicted test images) and report.md, which puts them on one page with each
scenario's diagnosis."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from modules.config import UserError
from modules.dataset import load_rgb
from modules.files import atomic_copy, atomic_save_figure, atomic_write_text
from modules.model_files import load_model
from modules.prediction import predict

LOSS_PNG = "training_loss_comparison.png"
ACCURACY_PNG = "training_accuracy_comparison.png"
COMPARISON_HTML = "training_comparison.html"
PLOTLY_JS = "plotly.min.js"  # the HTML charts' script, beside them
NA = "n/a"
BREAKDOWN_PNG = "step_time_breakdown.png"
CONFUSION_PNG = "confusion_matrix.png"
PREDICTIONS_PNG = "sample_predictions.png"
REPORT_MD = "report.md"


def step_breakdown(row: dict[str, Any]) -> dict[str, float] | None:
    """Milliseconds per step waiting for data, copying to the device (on a CPU, only the
    channels_last layout conversion) and computing."""
    step, wait, h2d = (finite_number(row.get(k)) for k in ("avg_step_ms", "data_wait_frac", "h2d_frac"))
    if step is None or wait is None:
        return None
    h2d = h2d or 0.0
    return {"data wait": step * wait, "layout/copy to device": step * h2d,
            "compute": max(0.0, step * (1.0 - wait - h2d))}


def plot_breakdown(rows: list[dict[str, Any]], out_dir: Path) -> Path | None:
    """Two panels: samples/s per scenario, and each scenario's step time split by phase."""
    parts = {r["scenario"]: step_breakdown(r) for r in rows}
    parts = {k: v for k, v in parts.items() if v is not None}
    if not parts:
        return None
    fig = figure(10, 4.5, dpi=120)
    rate_ax, step_ax = fig.subplots(1, 2)
    names = list(parts)
    rates = [finite_number(next(r for r in rows if r["scenario"] == n).get("samples_per_s"))
             for n in names]
    rate_ax.bar(names, [rate or 0.0 for rate in rates], color="C0")
    rate_ax.set_title("Training throughput")
    rate_ax.set_ylabel("samples / s")
    for i, rate in enumerate(rates):  # a missing figure is marked, not drawn as a measured 0
        rate_ax.annotate(NA if rate is None else f"{rate:.0f}", (i, rate or 0.0), ha="center",
                         va="bottom", fontsize="small")
    bottom = [0.0] * len(names)
    for j, phase in enumerate(("data wait", "layout/copy to device", "compute")):
        values = [parts[n][phase] for n in names]
        step_ax.bar(names, values, bottom=bottom, label=phase, color=f"C{j + 1}")
        bottom = [b + v for b, v in zip(bottom, values)]
    step_ax.set_title("Where each training step's time goes")
    step_ax.set_ylabel("ms per step")
    step_ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(out_dir) / BREAKDOWN_PNG
    atomic_save_figure(fig, path)
    return path


def figure(width: float, height: float, dpi: float | None = None):
    """A matplotlib Figure on its own Agg canvas rather than pyplot's: it renders headless
    without switching the process-wide backend a notebook may have chosen, and leaves no
    global figure open."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _save_labelled(fig, path: Path) -> None:
    """Lay out and save a chart labelled with class names. A name in a script the chart font
    lacks (CJK on Colab's and most Linux machines' DejaVu Sans) is drawn as boxes; matplotlib's
    warning for each such letter, with its source line, is not the user's to act on."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font",
                                category=UserWarning)
        fig.tight_layout()
        atomic_save_figure(fig, path)


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row with the highest validation accuracy, as the saved model is chosen (ties: the
    earlier scenario); by test accuracy only when no row has a validation accuracy."""
    for key in ("val_acc", "test_acc"):
        scored = [r for r in rows if finite_number(r.get(key)) is not None]
        if scored:
            return max(scored, key=lambda r: r[key])
    return None


CONFUSION_FULL = 30  # classes drawn in full: each cell's count, every class's accuracy


def plot_confusion(row: dict[str, Any], out_dir: Path, name: str = CONFUSION_PNG) -> Path | None:
    """The scenario's test confusion matrix (counts, shaded by share of the true class) and
    its per-class accuracy. `row`: a results row, or a saved model's `meta["extra"]`."""
    matrix = row.get("confusion_matrix")
    per_class = row.get("per_class_test_acc") or {}
    if not matrix or not per_class:
        return None
    names = list(per_class)
    n = len(names)
    side = min(n, CONFUSION_FULL)  # 100 classes drew a 10,340-px chart, with 2.5 GB and 14 s
    fig = figure(4 + 0.9 * side, 1.5 + 0.55 * side, dpi=110)
    grid_ax, acc_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    shares = [[v / max(1, sum(line)) for v in line] for line in matrix]
    grid_ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    if n <= CONFUSION_FULL:
        for i in range(n):
            for j in range(n):
                grid_ax.text(j, i, str(int(matrix[i][j])), ha="center", va="center",
                             fontsize="small", color="white" if shares[i][j] > 0.5 else "black")
        grid_ax.set_xticks(range(n), names, rotation=45, ha="right", fontsize="small")
        grid_ax.set_yticks(range(n), names, fontsize="small")
        grid_ax.set_xlabel("predicted")
        grid_ax.set_ylabel("true")
    else:  # shares only; the counts are in results.json's confusion_matrix
        grid_ax.set_xlabel(f"predicted (class index of {n}, as results.json orders them)")
        grid_ax.set_ylabel("true (class index)")
    grid_ax.set_title(f"{row['scenario']}: test confusion matrix")
    accs = [100 * per_class[k] if isinstance(per_class[k], (int, float))
            and math.isfinite(per_class[k]) else None for k in names]
    # the classes learned worst, when not all fit: those a user looks for
    shown = sorted(range(n), key=lambda i: (accs[i] is None, accs[i] or 0.0))[:CONFUSION_FULL] \
        if n > CONFUSION_FULL else list(range(n))
    # By position, not by name: class names that read as numbers ("0".."9") would make
    # matplotlib log its categorical-units notice into the run's log.
    acc_ax.barh(range(len(shown)), [accs[i] or 0.0 for i in shown], color="C2")
    acc_ax.set_yticks(range(len(shown)), [names[i] for i in shown], fontsize="small")
    acc_ax.invert_yaxis()
    acc_ax.set_xlim(0, 112)
    acc_ax.set_xlabel("test accuracy (%)")
    acc_ax.set_title("per class" if n <= CONFUSION_FULL else
                     f"per class: the {len(shown)} lowest of {n}")
    for row_at, i in enumerate(shown):
        acc_ax.annotate("no test images" if accs[i] is None else f"{accs[i]:.0f}",
                        (accs[i] or 0.0, row_at), va="center", fontsize="small")
    path = Path(out_dir) / name
    _save_labelled(fig, path)
    return path


def plot_predictions(model_path: Path, samples: list[tuple[str, int]], class_names: list[str],
                     out_dir: Path, *, n: int = 16, seed: int = 0) -> Path | None:
    """A grid of `n` test images (a seeded draw) with the saved model's prediction, its
    probability and the true label; green when right, red when wrong."""
    if not samples or not Path(model_path).exists():
        return None
    import random

    chosen = random.Random(seed).sample(samples, min(n, len(samples)))
    predictions = predict(load_model(model_path), [path for path, _ in chosen])
    # A test file gone or broken since the run, or a NaN output, has no prediction (predict
    # warned of it).
    kept = [(sample, pred) for sample, pred in zip(chosen, predictions) if pred["error"] is None]
    if not kept:
        return None
    chosen, predictions = [sample for sample, _ in kept], [pred for _, pred in kept]
    cols = min(4, len(chosen))
    rows = math.ceil(len(chosen) / cols)
    fig = figure(2.6 * cols, 2.8 * rows, dpi=110)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (path, label), pred in zip(axes.flat, chosen, predictions):
        ax.imshow(load_rgb(path))  # upright, any mode: as the model saw it
        truth = class_names[label]
        ax.set_title(f"{pred['label']} ({100 * pred['prob']:.0f}%)\ntrue: {truth}",
                     fontsize="small", color="green" if pred["label"] == truth else "red")
    path = Path(out_dir) / PREDICTIONS_PNG
    _save_labelled(fig, path)
    return path


def versus_baseline_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line a scenario: test accuracy with its standard error, the difference from the
    baseline, and the time it took, tuning included, against the baseline's."""
    lines = []
    for row in rows:
        acc, se = finite_number(row.get("test_acc")), finite_number(row.get("test_acc_se"))
        line = f"{row['scenario']}: test accuracy " + (
            "n/a" if acc is None else f"{100 * acc:.1f}%" + (f" +- {100 * se:.1f}" if se else ""))
        diff, ratio = finite_number(row.get("test_acc_vs_baseline")), finite_number(row.get("total_vs_baseline"))
        total = finite_number(row.get("total_s"))
        if row["scenario"] != "baseline" and diff is not None:
            line += f", {diff:+.1f} points against the baseline" + (
                f" of run {row['baseline_run_id']}" if row.get("baseline_run_id")
                not in (None, row.get("run_id")) else "")
        if total is not None:
            line += f", {total:.0f} s in all" + (
                f" ({ratio:.2f}x the baseline's)" if row["scenario"] != "baseline" and ratio
                else "")
        reached = row.get("time_to_baseline_acc_s")
        if row["scenario"] != "baseline" and row.get("baseline_acc_target") is not None:
            line += ("; reached the baseline's validation accuracy after "
                     f"{reached:.0f} s" + (" (tuning included)" if row.get("tuning_s") else "")
                     + (", in the trial its final run continues from"
                        if row.get("baseline_acc_reached_in") == "start trial" else "")
                     if reached is not None
                     else "; never reached the baseline's validation accuracy")
        line += "".join(f"; {note}" for note in final_run_notes(row))
        lines.append(line)
    if rows and all(r["scenario"] != "baseline" and r.get("test_acc_vs_baseline") is None
                    for r in rows):
        lines.append("no baseline to compare with: none in this run, nor a comparable earlier "
                     "one in its output folder; run the baseline scenario too (RUN_BASELINE, "
                     "--scenarios baseline)")
    return lines


def baseline_source_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A line naming the baseline the rows are compared with when it is another run's: the
    table's "vs Baseline" columns say nothing of where their baseline came from."""
    others = sorted({r["baseline_run_id"] for r in rows if r["scenario"] != "baseline"
                     and r.get("baseline_run_id") not in (None, r.get("run_id"))})
    return [f"Compared with the baseline of run {', '.join(others)}: another run in this "
            "folder with the same data, model and baseline settings (its row is in "
            "results.json)."] if others else []


def final_run_notes(row: dict[str, Any], detail: bool = False) -> list[str]:
    """What a row's final run was when it is not simply the scenario's own: phrases for the
    line against the baseline, or with `detail` sentences for the diagnosis."""
    notes = []
    if row.get("final_from"):
        notes.append(final_from_text(row, detail))
    if isinstance(row.get("replaced_final"), dict):
        text = replaced_text(row["replaced_final"])
        notes.append(f"It was {text}." if detail else text)
    if isinstance(row.get("grown_final"), dict):
        text = grown_text(row["grown_final"])
        notes.append(f"{text[0].upper()}{text[1:]}." if detail else text)
    return notes


def final_from_text(row: dict[str, Any], detail: bool = False) -> str:
    """What a row that took another scenario's final run is: that run reused instead of
    training it twice, or that run kept over the hpo scenario's own final run (the search's
    winner, or the kept default for other epochs), which validated below it
    (final_runs.default_if_better)."""
    source = row["final_from"]
    winner, default = row.get("winner_final"), row.get("default_final")
    if isinstance(winner, dict):
        text = (f"the search's winner was trained in full and validated{_at(winner)} below the "
                f"{source} scenario's final run, whose model and figures these are; the "
                f"winner's run counts as tuning")
    elif isinstance(default, dict):
        text = (f"the search kept the default configuration, trained it in full for "
                f"{default.get('epochs', '?')} epochs, and it validated{_at(default)} below the "
                f"{source} scenario's final run of that configuration ({row.get('epochs', '?')} "
                f"epochs), whose model and figures these are; its own run counts as tuning")
    else:
        text = f"its final run is the {source} scenario's, trained once"
        if detail:
            text += (": the same learning settings, start and epochs; its time counts in this "
                     "total, and its figures are that run's")
    if detail:
        text = text[0].upper() + text[1:] + (" (the speed settings below are those this "
                                             "scenario's search and own runs trained with; the "
                                             "figures above are that run's).")
    return text


def replaced_text(replaced: dict[str, Any]) -> str:
    """The final run a grown study set aside (scenario.replaced_final)."""
    figures = (f"validated at {100 * replaced['val_acc']:.1f}% and tested at "
               f"{100 * replaced['test_acc']:.1f}%"
               if finite_number(replaced.get("val_acc")) is not None
               and finite_number(replaced.get("test_acc")) is not None
               else f"cut short after {replaced.get('epochs', '?')} epochs")
    return (f"trained again after the study grew and changed the choice: the earlier final run "
            f"{figures}, kept as {Path(str(replaced.get('checkpoint', '?'))).name}, its "
            f"{finite_number(replaced.get('seconds')) or 0:.0f} s counted as tuning")


def _at(final: dict[str, Any]) -> str:
    """ " at 92.8% (test 90.0%)," for a final run that gave way, or "" where its figures are
    missing (never 0.0%)."""
    val, test = finite_number(final.get("val_acc")), finite_number(final.get("test_acc"))
    return f" at {100 * val:.1f}% (test {100 * test:.1f}%)," \
        if val is not None and test is not None else ""


def grown_text(grown: dict[str, Any]) -> str:
    """The final run of a grown study's new choice, which validated below the final run before
    it and gave way to it (final_runs.earlier_if_better)."""
    return (f"after the study grew, its new choice was trained in full and validated{_at(grown)} "
            f"below the final run before it, whose model and figures these are; the new run "
            f"counts as tuning")


def autotune_lines(report: dict[str, Any] | None) -> list[str]:
    """What the autotuner chose for each knob and the measurement behind it."""
    if not report:
        return []
    at = f" at {report['image_size']} px" if report.get("image_size") else ""
    lines = [f"Autotune{at} ({report.get('seconds', '?')} s of measuring on {report.get('device')}, "
             f"{report.get('compute_img_s')} img/s pure compute at the end"
             + (", reused from " + report["reused_from"] if report.get("reused_from")
                else "")
             + (", in an earlier session of this run" if report.get("resumed_from") else "")
             + "):", ""]
    for knob, entry in (report.get("knobs") or {}).items():
        choice = entry.get("choice")
        choice = str(choice).lower() if isinstance(choice, bool) else choice
        lines.append(f"- `{knob}` = {choice}: {entry.get('reason', '')}")
    return lines + [""]


def earlier_runs_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per other run in results.json: its id, dataset, scenarios and best test
    accuracy, newest first."""
    runs: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        runs.setdefault(row.get("run_id"), []).append(row)
    lines = []
    # ids are UTC times: newest first, then rows written before runs had ids
    for run_id, members in sorted(runs.items(), key=lambda kv: (kv[0] is not None, str(kv[0])),
                                  reverse=True):
        best = best_row(members)
        dataset = members[0].get("dataset") or "data not recorded"
        lines.append(f"- {run_id or 'before run ids'}: {dataset}, "
                     + ", ".join(r["scenario"] for r in members)
                     + (f"; best {best['scenario']}, test accuracy {100 * best['test_acc']:.1f}%"
                        if best and finite_number(best.get("test_acc")) is not None else ""))
    return lines


def render_report(rows: list[dict[str, Any]], charts: list[str],
                  earlier: list[dict[str, Any]] | None = None,
                  unfinished: list[str] | None = None) -> str:
    """The markdown text of report.md: this run's rows; earlier runs listed at the end.
    unfinished: the scenarios the run was to train that did not finish (stopped or failed)."""
    run_id = rows[0].get("run_id") if rows else None
    lines = ["# Training report" + (f": run {run_id}" if run_id else ""), ""]
    if unfinished:
        lines += [f"**Incomplete run:** {', '.join(unfinished)} did not finish (stopped or "
                  "failed); `--resume` continues it.", ""]
    lines += [table_markdown(results_table(rows)), "",
              "Accuracies and data wait in percent; Step and CPU Exec are per batch (with "
              "gradient accumulation an optimizer step takes several); CPU Exec is the "
              "training process's own CPU time (its loader workers' is not in it); Peak Mem "
              "(MiB: 2^20 bytes) on a CPU is the "
              "process's peak RSS, which holds what the run's earlier scenarios left; n/a = "
              "not measured on this hardware, or no baseline to compare with; never = its "
              "validation never reached the baseline's. Val Acc chose each model's epoch (and "
              "in the tuned scenarios its size and settings), so it reads high; Test Acc, on "
              "images nothing was chosen by, is the estimate of accuracy on new images.", ""]
    source = baseline_source_lines(rows)
    lines += [*source, ""] if source else []
    lines += ["## Diagnosis", ""]
    for row in rows:
        diag = row.get("diagnosis") or {}
        settings = row.get("settings") or {}
        lines.append(f"### {row['scenario']}")
        lines.append("")
        lines.append(f"{settings.get('model', '?')} at {row.get('best_resolution')} px, batch "
                     f"{settings.get('batch_size')}, {settings.get('amp_dtype', 'fp32')} on "
                     f"{settings.get('device', '?')}."
                     + "".join(f" {note}" for note in final_run_notes(row, detail=True))
                     + (f" Started from {row['start_weights']}."
                        if str(row.get("start_weights", "")).startswith("random") else "")
                     + (f" Ran out of memory in training {settings['oom_recoveries']}x and went "
                        f"on in micro-batches of {settings.get('micro_batch_size')} images."
                        if settings.get("oom_recoveries") else ""))
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
        lines += ["## Other runs in this folder", "",
                  "Their rows stay in results.json; their checkpoints, scalars and traces in "
                  "checkpoints/, runs/ and profiler/ under the run's id.", ""]
        lines += earlier_runs_lines(earlier) + [""]
    return "\n".join(lines)


def write_report(rows: list[dict[str, Any]], out_dir: Path,
                 earlier: list[dict[str, Any]] | None = None,
                 unfinished: list[str] | None = None, also: tuple[str, ...] = (),
                 copy_to: Path | None = None) -> Path:
    """report.md and its charts in out_dir; with copy_to, a copy of them there too (with
    `also`, further files of this run in out_dir), which the next run does not write over."""
    out_dir = Path(out_dir)
    charts = [name for name in (LOSS_PNG, ACCURACY_PNG) if (out_dir / name).exists()]
    best = best_row(rows)
    for chart in (plot_breakdown(rows, out_dir), best and plot_confusion(best, out_dir)):
        if chart is not None:
            charts.append(chart.name)
    # the tuners' own charts of this run (resolution_tradeoff.png, optuna_*.png)
    charts += [name for name in also if name.endswith(".png") and (out_dir / name).is_file()]
    path = out_dir / REPORT_MD
    atomic_write_text(render_report(rows, charts, earlier, unfinished), path)
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for name in (REPORT_MD, COMPARISON_HTML, *charts, *also):
            if not (out_dir / name).is_file():
                continue
            if name.endswith(".html"):  # its script stays one file, the output folder's
                bundle = Path(os.path.relpath(out_dir / PLOTLY_JS, copy_to)).as_posix()
                page = (out_dir / name).read_text(encoding="utf-8")
                atomic_write_text(page.replace(f'src="{PLOTLY_JS}"', f'src="{bundle}"'),
                                  copy_to / name)
            else:  # a copy, not a link: an editor may save in place
                atomic_copy(out_dir / name, copy_to / name)
    return path


# --------------------------------------------------------------------------- results table

# (results.json key, header, how to show it). "pct" keys hold fractions 0-1.
_COLUMNS = (
    ("train_acc", "Train Acc (%)", "pct"),
    ("val_acc", "Val Acc (%)", "pct"),
    ("test_acc", "Test Acc (%)", "pct"),
    ("train_loss", "Train Loss", "loss"),
    ("test_loss", "Test Loss", "loss"),
    ("best_resolution", "Best Resolution", "int"),
    ("epochs", "Epochs", "int"),
    ("gpu_util_pct", "GPU Util (%)", "1f"),
    ("cpu_util_pct", "CPU Util (%)", "1f"),
    ("cpu_exec_us", "CPU Exec (us/batch)", "0f"),
    ("avg_step_ms", "Step (ms)", "2f"),
    ("samples_per_s", "Throughput (img/s)", "1f"),
    ("peak_mem_mb", "Peak Mem (MiB)", "0f"),
    ("data_wait_frac", "Data Wait (%)", "pct"),
    ("wall_s", "Train (s)", "1f"),
    ("prepare_s", "Setup (s)", "1f"),  # model and loaders (the cache's decode): in Total
    ("tuning_s", "Tuning (s)", "1f"),
    ("total_s", "Total (s)", "1f"),
    ("test_acc_vs_baseline", "Test Acc vs Baseline (pts)", "signed"),
    ("total_vs_baseline", "Time vs Baseline (x)", "2f"),
    ("time_to_baseline_acc_s", "To Baseline Val Acc (s)", "1f"),
    ("skipped_files", "Skipped Files", "int"),
    ("diagnosis", "Bottleneck", "diagnosis"),
)


NEVER = "never"  # compared with a baseline, and never reached its validation accuracy


def results_table(rows: list[dict]):
    """The scenario results as a pandas DataFrame of display strings, indexed by scenario.

    Accuracies and the data-wait fraction are shown as percentages; a missing or None value is
    "n/a" (never 0, which would read as a measurement), and a time to the baseline's
    accuracy that was compared but never reached is "never".
    """
    import pandas as pd  # only the reporting path needs pandas

    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"results_table needs a list of result dicts, but got {type(rows).__name__}.")
    data = [[NEVER if key == "time_to_baseline_acc_s" and row.get(key) is None
             and row.get("baseline_acc_target") is not None else _cell(row.get(key), kind)
             for key, _, kind in _COLUMNS] for row in rows]
    index = pd.Index([str(row.get("scenario", NA)) for row in rows], name="Scenario")
    return pd.DataFrame(data, index=index, columns=[header for _, header, _ in _COLUMNS],
                        dtype=object)


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return NA
    if kind == "diagnosis" and isinstance(value, dict):  # modules.diagnosis.diagnose's result
        return str(value.get("bottleneck", NA))
    if kind in ("text", "diagnosis") or isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # a diverged loss shows as nan/inf rather than vanishing
    if kind == "pct":
        return f"{value * 100:.1f}"
    if kind == "signed":
        return f"{value:+.1f}"
    if kind == "loss":
        return f"{value:.4f}"
    if kind == "int":
        return str(int(value)) if float(value).is_integer() else f"{value:g}"
    return f"{value:.{kind[0]}f}"


def table_markdown(df) -> str:
    """`df` as a GitHub-flavoured markdown table (index first), without the tabulate package."""
    header = [str(df.index.name or "")] + [str(c) for c in df.columns]
    lines = [_md_row(header), "|" + "|".join("---" for _ in header) + "|"]
    for label, values in zip(df.index, df.itertuples(index=False)):
        lines.append(_md_row([label, *values]))
    return "\n".join(lines)


def _md_row(cells) -> str:
    return "| " + " | ".join(_md_escape(c) for c in cells) + " |"


def _md_escape(value: Any) -> str:
    text = NA if value is None else str(value)
    # A bare "|" would split the cell; a newline would end the row.
    return text.replace("|", "\\|").replace("\r", " ").replace("\n", " ")


# --------------------------------------------------------------------------- training curves

def plot_comparison(histories: dict[str, list[dict]], out_dir) -> list[Path]:
    """Loss and accuracy curves per scenario (train solid, val dashed), as two PNGs and one
    interactive HTML that works offline (plotly.min.js is written beside it).

    Returns the written paths; with nothing to plot, writes nothing and returns [].
    """
    if not isinstance(histories, dict):
        raise UserError(f"histories must map scenario -> list of epoch dicts, but got "
                        f"{type(histories).__name__}.")
    series = _series(histories)
    if not any(points for curves in series.values() for points in curves.values()):
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        _plot_png(series, "loss", "Training loss by scenario", "Loss", out_dir / LOSS_PNG),
        _plot_png(series, "acc", "Training accuracy by scenario", "Accuracy (%)",
                  out_dir / ACCURACY_PNG),
    ]
    written.extend(_plot_html(series, out_dir / COMPARISON_HTML))
    return written


def _curves(name: str, epochs) -> dict[str, list[tuple[float, float]]]:
    """{"train_loss": [(epoch, value), ...], ...} with accuracies in percent, bad points dropped."""
    if not isinstance(epochs, (list, tuple)):
        raise UserError(f"history of scenario {name!r} must be a list of epoch dicts, but got "
                        f"{type(epochs).__name__}.")
    curves: dict[str, list[tuple[float, float]]] = {}
    for key in ("train_loss", "val_loss", "train_acc", "val_acc"):
        scale = 100.0 if key.endswith("_acc") else 1.0
        points = []
        for i, row in enumerate(epochs):
            if not isinstance(row, dict):
                continue
            x, y = finite_number(row.get("epoch", i + 1)), finite_number(row.get(key))
            if x is not None and y is not None:
                points.append((x, y * scale))
        curves[key] = points
    return curves


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite number, else None (missing, NaN, inf, text)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _color(i: int) -> str:
    from matplotlib.colors import to_hex

    # Same colour per scenario in the PNGs and the HTML, so the two can be read side by side.
    return to_hex(f"C{i % 10}")


def _plot_png(series: dict, metric: str, title: str, ylabel: str, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    fig = figure(8, 5, dpi=120)
    ax = fig.add_subplot()
    for i, (name, curves) in enumerate(series.items()):
        for split, style in (("train", "-"), ("val", "--")):
            points = curves[f"{split}_{metric}"]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, color=_color(i), marker="o", markersize=3,
                        label=f"{name} ({split})")
    ax.set_title(title)
    ax.set_xlabel("Epoch")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    atomic_save_figure(fig, path)
    return path


def comparison_figure(histories: dict[str, list[dict]]):
    """The interactive loss/accuracy figure of plot_comparison's HTML, for a notebook to show."""
    return _plotly_figure(_series(histories))


def _series(histories: dict[str, list[dict]]) -> dict[str, dict]:
    """Each scenario's curves, by a label that says when its run is an earlier scenario's (the
    hpo scenario taking the resolution final run's model): drawn over it, it hides it."""
    series: dict[str, dict] = {}
    for name, epochs in histories.items():
        curves = _curves(name, epochs)
        same = next((earlier for earlier, drawn in series.items() if drawn == curves
                     and any(curves.values())), None)
        series[name if same is None else f"{name} (= {same.split(' (')[0]}'s run)"] = curves
    return series


def _plotly_figure(series: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("Loss", "Accuracy (%)"))
    for i, (name, curves) in enumerate(series.items()):
        for col, metric in ((1, "loss"), (2, "acc")):
            for split, dash in (("train", "solid"), ("val", "dash")):
                points = curves[f"{split}_{metric}"]
                if not points:
                    continue
                xs, ys = zip(*points)
                fig.add_trace(go.Scatter(
                    x=xs, y=ys, mode="lines+markers", name=f"{name} ({split})",
                    line={"color": _color(i), "dash": dash},
                    # One legend entry per scenario/split toggles both subplots together.
                    legendgroup=f"{name} ({split})", showlegend=(col == 1)), row=1, col=col)
    fig.update_xaxes(title_text="Epoch")
    fig.update_yaxes(title_text="Loss", row=1, col=1)
    fig.update_yaxes(title_text="Accuracy (%)", row=1, col=2)
    fig.update_layout(title="Training comparison by scenario", template="plotly_white")
    return fig


def _plot_html(series: dict, path: Path) -> list[Path]:
    return [path, write_html(_plotly_figure(series), path)]


def write_html(fig, path: Path) -> Path:
    """A plotly figure's page at `path`, its script in plotly.min.js beside it (not inlined
    nor from a CDN: the page opens offline), each written whole or not at all. Returns the
    script's path."""
    import plotly

    bundle = path.parent / PLOTLY_JS
    script = plotly.offline.get_plotlyjs()
    # One left by another plotly version could break the page: replaced when it differs.
    if not bundle.exists() or bundle.read_text(encoding="utf-8", errors="replace") != script:
        atomic_write_text(script, bundle)
    atomic_write_text(fig.to_html(include_plotlyjs="directory", full_html=True), path)
    return bundle
