"""Evaluating, saving, loading and predicting with trained models; the results table and the training-curve
plots (PNG and offline plotly HTML) that compare scenarios."""
from __future__ import annotations

import json
import logging
import math
import os
import reprlib
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassConfusionMatrix

from modules import distributed
from modules.config import (IMAGENET_MEAN, IMAGENET_STD, MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, MODELS,
                            UserError)
from modules.dataset import eval_transform, load_rgb
from modules.files import atomic_torch_save, read_torch_file
from modules.models import build_model
from modules.oom import is_out_of_memory, more_pieces, release

log = logging.getLogger(__name__)

FORMAT_NAME = "imgcls-model"
FORMAT_VERSION = 1

LOSS_PNG = "training_loss_comparison.png"
ACCURACY_PNG = "training_accuracy_comparison.png"
COMPARISON_HTML = "training_comparison.html"

NA = "n/a"


# --------------------------------------------------------------------------- saving and loading

def save_model(model: nn.Module, path, *, arch: str, class_names, image_size: int,
               mean=IMAGENET_MEAN, std=IMAGENET_STD, extra: dict | None = None) -> Path:
    """Write `model` with everything needed to rebuild and use it; returns the path written.

    The file holds only plain Python types and CPU tensors, so
    `torch.load(path, weights_only=True)` reads it without executing code.
    """
    path = Path(path)
    names = _check_class_names(class_names)
    _check_meta(arch, image_size, mean, std)
    payload = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "num_classes": len(names),
        "class_names": names,
        "image_size": int(image_size),
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
        "state_dict": _cpu_state_dict(model),
        "extra": _json_roundtrip(extra),
    }
    atomic_torch_save(payload, path)
    return path


def load_model(path, device="cpu") -> nn.Module:
    """Rebuild a model written by `save_model`, in eval mode, with its metadata in `model.meta`."""
    path = Path(path)
    payload = _read_payload(path)
    _check_state_dict_fits(payload, path)
    model = build_model(payload["arch"], payload["num_classes"], weights="none")
    try:
        model.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"model file {str(path)!r} does not match architecture "
                        f"{payload['arch']!r}: {first}") from None
    model.to(device).eval()
    model.meta = {
        "arch": payload["arch"],
        "class_names": list(payload["class_names"]),
        "image_size": payload["image_size"],
        "mean": tuple(payload["mean"]),
        "std": tuple(payload["std"]),
        "extra": payload.get("extra"),
    }
    return model


# Values quoted in errors are abridged: a damaged or hostile file may hold huge ones.
_abridged = reprlib.Repr()
_abridged.maxlist = _abridged.maxdict = 4
_abridged.maxstring = _abridged.maxother = 40
_short = _abridged.repr


def _check_class_names(class_names) -> list[str]:
    if isinstance(class_names, str) or not isinstance(class_names, Iterable):
        raise UserError(f"class_names must be a list of strings, but got {_short(class_names)}.")
    names = list(class_names)
    if not all(isinstance(n, str) for n in names):
        raise UserError(f"class_names must all be strings, but got {_short(names)}.")
    # predict() returns probabilities keyed by class name, so names must be unique.
    if len(set(names)) != len(names):
        raise UserError(f"class_names must be unique, but got {_short(names)}.")
    if len(names) < 2:
        raise UserError(f"a classifier needs at least 2 class_names, but got {_short(names)}.")
    return names


def _check_meta(arch: str, image_size: int, mean, std) -> None:
    # Checked at save time, where a file that load_model cannot rebuild is caught early, and
    # again at load time, where a file may claim anything: predict() allocates
    # image_size**2 per image.
    if not isinstance(arch, str) or arch not in MODELS:
        raise UserError(f"arch must be one of {', '.join(MODELS)}, but got {_short(arch)}.")
    low = MIN_IMAGE_SIZE[arch]
    if isinstance(image_size, bool) or not isinstance(image_size, int) or \
            not low <= image_size <= MAX_IMAGE_SIZE:
        raise UserError(f"image_size must be an integer in {low}..{MAX_IMAGE_SIZE} for {arch}, "
                        f"but got {_short(image_size)}.")
    for name, values in (("mean", mean), ("std", std)):
        try:  # numbers of any kind (numpy, 0-d tensors), but not text that float() would read
            ok = not isinstance(values, (str, bytes, dict)) and len(values) == 3 and all(
                not isinstance(v, (str, bytes, bool)) and math.isfinite(float(v))
                for v in values)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UserError(f"{name} must be 3 finite numbers (R, G, B), but got "
                            f"{_short(values)}.")
    if any(float(v) <= 0 for v in std):
        raise UserError(f"std must be > 0 for every channel, but got {_short(std)}.")


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain module under torch.compile (`_orig_mod`) and DDP/DataParallel (`module`)."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def _strip_prefixes(key: str) -> str:
    # A state_dict taken from a wrapper (or saved by one earlier) carries these prefixes;
    # build_model's plain module has none.
    changed = True
    while changed:
        changed = False
        for prefix in ("_orig_mod.", "module."):
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


def _cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    if not isinstance(model, nn.Module):
        raise UserError(f"save_model needs a torch.nn.Module, but got {type(model).__name__}.")
    state = {}
    for key, tensor in _unwrap(model).state_dict().items():
        # clone: a CPU model's tensors would otherwise share storage with the live weights.
        state[_strip_prefixes(key)] = tensor.detach().to("cpu", copy=True).contiguous()
    return state


def _json_roundtrip(extra: dict | None) -> dict | None:
    """`extra` as plain JSON types, so weights_only loading accepts it (numpy floats would not)."""
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise UserError(f"extra must be a dict or None, but got {type(extra).__name__}.")
    try:
        return json.loads(json.dumps(extra, default=_json_scalar))
    except (TypeError, ValueError) as exc:
        raise UserError(f"extra must be JSON-serialisable: {exc}") from None


def _json_scalar(value: Any) -> Any:
    # numpy / torch scalars (an accuracy left as np.float64 or a 0-d tensor) become numbers.
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} {value!r} is not JSON-serialisable")


def _read_payload(path: Path) -> dict:
    payload = read_torch_file(path, "model file")
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT_NAME):
        raise UserError(f"{str(path)!r} is not a model saved by save_model (a bare state_dict? "
                        "use --weights PATH to load one into a new model).")
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise UserError(f"{str(path)!r} has model format version {version!r}; this code reads "
                        f"version {FORMAT_VERSION}.")
    missing = [k for k in ("arch", "num_classes", "class_names", "image_size", "mean", "std",
                           "state_dict") if k not in payload]
    if missing:
        raise UserError(f"{str(path)!r} is missing {', '.join(missing)}; the file is damaged.")
    try:
        if not isinstance(payload["class_names"], list):
            raise UserError(f"class_names must be a list of strings, but got "
                            f"{_short(payload['class_names'])}.")
        _check_class_names(payload["class_names"])
        _check_meta(payload["arch"], payload["image_size"], payload["mean"], payload["std"])
        state = payload["state_dict"]
        if not (isinstance(state, dict) and state and all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())):
            raise UserError("state_dict must map parameter names to tensors, but got "
                            f"{_short(state)}.")
    except UserError as exc:
        raise UserError(f"model file {str(path)!r} is damaged: {exc}") from None
    if payload["num_classes"] != len(payload["class_names"]):
        raise UserError(f"{str(path)!r} has num_classes={_short(payload['num_classes'])} but "
                        f"{len(payload['class_names'])} class_names; the file is damaged.")
    return payload


def _check_state_dict_fits(payload: dict, path: Path) -> None:
    """The file's tensors against the shapes its architecture and class count need, on the
    meta device: no memory is spent on a model the file cannot fill (its class count alone
    could ask for gigabytes)."""
    with torch.device("meta"):
        wanted = build_model(payload["arch"], payload["num_classes"], weights="none").state_dict()
    state = payload["state_dict"]
    problems = [f"missing {k}" for k in wanted if k not in state] + \
               [f"unexpected {_short(k)}" for k in state if k not in wanted] + \
               [f"{k} is {tuple(state[k].shape)}, not {tuple(v.shape)}"
                for k, v in wanted.items() if k in state and state[k].shape != v.shape]
    if problems:
        raise UserError(f"model file {str(path)!r} does not match architecture "
                        f"{payload['arch']!r} with {payload['num_classes']} classes: "
                        f"{'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''}.")


# --------------------------------------------------------------------------- prediction

@torch.no_grad()
def evaluate(model: nn.Module, loader, *, device: torch.device | str | None = None,
             amp_dtype: torch.dtype | None = None, channels_last: bool = False,
             num_classes: int | None = None) -> dict[str, Any]:
    """Loss, accuracy, per-class accuracy and confusion matrix of `model` over `loader`.

    A batch that runs out of memory is run again in halves (then quarters ...) for the rest of
    the call, each halving said in the log; the figures do not depend on the pieces."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    num_classes = int(num_classes or model.num_classes)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    # Summed across processes below, only when each evaluated its own share (torchmetrics
    # would otherwise sum whole copies under torchrun).
    confusion = MulticlassConfusionMatrix(num_classes=num_classes, sync_on_compute=False).to(device)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    was_training = model.training
    model.eval()
    splits = 1
    try:
        for x, y in loader:
            x = x.to(device, non_blocking=True, memory_format=memory_format)
            y = y.to(device, non_blocking=True)
            while True:
                try:
                    logits = _logits(model, x, splits, device, amp_dtype)
                    break
                except RuntimeError as exc:
                    if not is_out_of_memory(exc):
                        raise
                # outside the except block, whose traceback holds the failed pass's tensors
                release(device)
                splits = _smaller_pieces(splits, x.shape[0], tuple(x.shape[2:]))
            loss_sum += F.cross_entropy(logits.float(), y, reduction="sum")
            confusion.update(logits, y)
    finally:
        model.train(was_training)
    matrix = confusion.compute()
    if getattr(getattr(loader, "sampler", None), "sharded", False):
        # Under torchrun each process evaluated its own share (EvalShard): sum the shares.
        distributed.all_reduce_sum(matrix)
        distributed.all_reduce_sum(loss_sum)
    matrix = matrix.cpu()
    total = int(matrix.sum())
    if total == 0:
        return {"loss": float("nan"), "acc": float("nan"), "per_class_acc": [], "confusion": [],
                "n": 0}
    per_class = matrix.diag() / matrix.sum(dim=1).clamp(min=1)
    return {"loss": loss_sum.item() / total, "acc": matrix.diag().sum().item() / total,
            "per_class_acc": per_class.tolist(), "confusion": matrix.tolist(), "n": total}


def _logits(model: nn.Module, x: torch.Tensor, splits: int, device: torch.device,
            amp_dtype: torch.dtype | None) -> torch.Tensor:
    """model(x) in `splits` pieces, concatenated."""
    size = math.ceil(x.shape[0] / splits)
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                        enabled=amp_dtype is not None):
        if size >= x.shape[0]:
            return model(x)
        return torch.cat([model(piece) for piece in x.split(size)])


def _smaller_pieces(splits: int, n: int, image_shape: tuple[int, ...]) -> int:
    """Twice the pieces per evaluation batch after running out of memory, or OutOfMemoryError
    when a piece already held a single image."""
    more = more_pieces(splits, n, f"out of memory evaluating even one {image_shape[-1]} px image "
                                  "at a time; lower --image-size or use a smaller --model.")
    log.warning("out of memory evaluating batches of %d; continuing in pieces of %d",
                math.ceil(n / splits), math.ceil(n / more))
    return more


def predict(model: nn.Module, image_paths, *, batch_size: int = 32, device=None) -> list[dict]:
    """Classify image files with a model from `load_model`.

    Returns one dict per path, in order: {"path", "label", "prob", "probs": {class: prob}}.
    `device`: None keeps the model where it is; otherwise the model is moved there.
    """
    meta = getattr(model, "meta", None)
    if not isinstance(meta, dict) or "class_names" not in meta:
        raise UserError("predict needs a model from load_model (it has no .meta with class_names).")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, but got {batch_size!r}.")
    # A lone path would otherwise be iterated character by character.
    if isinstance(image_paths, (str, os.PathLike)):
        image_paths = [image_paths]
    paths = [str(p) for p in image_paths]
    if device is not None:
        model.to(device)
    device = _model_device(model)
    transform = eval_transform(meta["image_size"], meta["mean"], meta["std"])
    results: list[dict] = []
    was_training = model.training
    model.eval()  # BatchNorm/Dropout must not use batch statistics at inference
    try:
        for start in range(0, len(paths), batch_size):
            chunk = paths[start:start + batch_size]
            batch = torch.stack([transform(_decode(p)) for p in chunk]).to(device)
            probs = _softmax(model, batch)
            results.extend(_describe(p, row, meta["class_names"]) for p, row in zip(chunk, probs))
    finally:
        model.train(was_training)
    return results


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _decode(path: str):
    try:
        return load_rgb(path)
    except Exception as exc:  # missing, truncated, not an image, decompression bomb ...
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise UserError(f"cannot decode image {path!r}: {reason}") from None


def _softmax(model: nn.Module, batch: torch.Tensor) -> list[list[float]]:
    with torch.inference_mode():
        logits = model(batch)
    # float32 softmax: half-precision logits would give probabilities that visibly miss 1.
    return logits.float().softmax(dim=1).cpu().tolist()


def _describe(path: str, probs: list[float], class_names: list[str]) -> dict:
    best = max(range(len(probs)), key=probs.__getitem__)
    return {
        "path": path,
        "label": class_names[best],
        "prob": float(probs[best]),
        "probs": {name: float(p) for name, p in zip(class_names, probs)},
    }


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
    ("cpu_exec_us", "CPU Exec (us)", "0f"),
    ("avg_step_ms", "Step (ms)", "2f"),
    ("samples_per_s", "Throughput (img/s)", "1f"),
    ("peak_mem_mb", "Peak Mem (MB)", "0f"),
    ("data_wait_frac", "Data Wait (%)", "pct"),
    ("wall_s", "Train (s)", "1f"),
    ("tuning_s", "Tuning (s)", "1f"),
    ("total_s", "Total (s)", "1f"),
    ("test_acc_vs_baseline", "Test Acc vs Baseline (pts)", "signed"),
    ("total_vs_baseline", "Time vs Baseline (x)", "2f"),
    ("time_to_baseline_acc_s", "To Baseline Val Acc (s)", "1f"),
    ("skipped_files", "Skipped Files", "int"),
    ("diagnosis", "Bottleneck", "diagnosis"),
)


def results_table(rows: list[dict]):
    """The scenario results as a pandas DataFrame of display strings, indexed by scenario.

    Accuracies and the data-wait fraction are shown as percentages; a missing or None value is
    "n/a" (never 0, which would read as a measurement).
    """
    import pandas as pd  # only the reporting path needs pandas

    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"results_table needs a list of result dicts, but got {type(rows).__name__}.")
    data = [[_cell(row.get(key), kind) for key, _, kind in _COLUMNS] for row in rows]
    index = pd.Index([str(row.get("scenario", NA)) for row in rows], name="Scenario")
    return pd.DataFrame(data, index=index, columns=[header for _, header, _ in _COLUMNS],
                        dtype=object)


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return NA
    if kind == "diagnosis" and isinstance(value, dict):  # modules.profiler.diagnose's result
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
    series = {name: _curves(name, epochs) for name, epochs in histories.items()}
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
            x, y = _finite(row.get("epoch", i + 1)), _finite(row.get(key))
            if x is not None and y is not None:
                points.append((x, y * scale))
        curves[key] = points
    return curves


def _finite(value: Any) -> float | None:
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
    # Figure + FigureCanvasAgg instead of pyplot: renders headless without switching the
    # process-wide backend a notebook may have chosen, and leaves no global figure open.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
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
    fig.savefig(path)
    return path


def comparison_figure(histories: dict[str, list[dict]]):
    """The interactive loss/accuracy figure of plot_comparison's HTML, for a notebook to show."""
    return _figure({name: _curves(name, epochs) for name, epochs in histories.items()})


def _figure(series: dict):
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
                    legendgroup=f"{name} ({split})", showlegend=(col == 1)))
    fig.update_xaxes(title_text="Epoch")
    fig.update_yaxes(title_text="Loss", row=1, col=1)
    fig.update_yaxes(title_text="Accuracy (%)", row=1, col=2)
    fig.update_layout(title="Training comparison by scenario", template="plotly_white")
    return fig


def _plot_html(series: dict, path: Path) -> list[Path]:
    import plotly

    fig = _figure(series)
    bundle = path.parent / "plotly.min.js"
    # plotly keeps an existing plotly.min.js; one left by another plotly version could break
    # the page, so refresh it when it differs from the version that writes the HTML.
    if bundle.exists() and bundle.read_text(encoding="utf-8", errors="replace") \
            != plotly.offline.get_plotlyjs():
        bundle.unlink()
    fig.write_html(path, include_plotlyjs="directory", full_html=True, auto_open=False)
    return [path, bundle]
