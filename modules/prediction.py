"""Prediction: class probabilities for image files from a model that load_model rebuilt."""
from __future__ import annotations

import logging
import math
import os

import torch
from torch import nn

from modules.config import UserError, first_line
from modules.dataset import eval_transform, load_rgb
from modules.device import library_device

log = logging.getLogger(__name__)


def predict(model: nn.Module, image_paths, *, batch_size: int = 32, device=None) -> list[dict]:
    """Classify image files with a model from `load_model`.

    Returns one dict per path, in order: {"path", "label", "prob", "probs": {class: prob},
    "error"}. A file that cannot be decoded (missing, truncated, not an image), or whose output
    is NaN/inf (a diverged model), is not a reason to lose the others' predictions: its dict
    has label and prob None, empty probs and the reason in "error" (None for every other), and
    one warning counts such files.
    `device`: None keeps the model where it is; otherwise the model is moved there.
    """
    meta = getattr(model, "meta", None)
    if not isinstance(meta, dict) or "class_names" not in meta:
        raise UserError("predict needs a model from load_model (it has no .meta with class_names).")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, but got {batch_size!r}.")
    # A lone path would otherwise be iterated character by character.
    if isinstance(image_paths, (str, bytes, os.PathLike)):
        image_paths = [image_paths]
    paths = [_path(p) for p in (image_paths if hasattr(image_paths, "__iter__")
                                else [image_paths])]
    if device is not None:
        model.to(library_device(device))
    device = _model_device(model)
    transform = eval_transform(meta["image_size"], meta["mean"], meta["std"])
    # A model saved before 2026-12-07 from the decoded cache was tested on JPEGs decoded at
    # reduced scale (PIL's draft) before the resize: the same decode gives it those pixels.
    draft = meta["image_size"] if (meta.get("extra") or {}).get("decode") == "draft" else None
    results: list[dict | None] = [None] * len(paths)
    readable: list[tuple[int, torch.Tensor]] = []
    was_training = model.training
    model.eval()  # BatchNorm/Dropout must not use batch statistics at inference
    try:
        for index, path in enumerate(paths):
            image, error = _decode(path, draft)
            if image is None:
                results[index] = {"path": path, "label": None, "prob": None, "probs": {},
                                  "error": error}
            else:
                readable.append((index, transform(image)))
            if len(readable) == batch_size or (index == len(paths) - 1 and readable):
                probs = _softmax(model, torch.stack([t for _, t in readable]).to(device))
                for (i, _), row in zip(readable, probs):
                    results[i] = _describe(paths[i], row, meta["class_names"])
                readable = []
    finally:
        model.train(was_training)
    failed = [r for r in results if r["error"] is not None]
    if failed:
        log.warning("%d of %d image(s) have no prediction (first: %r: %s); their entries say "
                    "why in \"error\".", len(failed), len(paths), failed[0]["path"],
                    failed[0]["error"])
    return results


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _path(item) -> str:
    """A file path as predict reads it; anything else (a PIL image, an array, a tensor, read
    into paths by str() as a file named after its repr) is refused in one line."""
    if not isinstance(item, (str, bytes, os.PathLike)):
        raise UserError(f"predict takes image file paths, but got a {type(item).__name__}; "
                        "save the image to a file and pass its path.")
    return os.fsdecode(item)


def _decode(path: str, draft: int | None = None):
    """(image, None), or (None, the one-line reason) for a file that cannot be decoded."""
    try:
        return load_rgb(path, draft=draft), None
    except Exception as exc:  # missing, truncated, not an image, decompression bomb ...
        return None, first_line(exc)


def _softmax(model: nn.Module, batch: torch.Tensor) -> list[list[float]]:
    with torch.inference_mode():
        logits = model(batch)
    # float32 softmax: half-precision logits would give probabilities that visibly miss 1.
    return logits.float().softmax(dim=1).cpu().tolist()


NOT_FINITE = "the model's output is NaN/inf for this image (a diverged or overflowing model)"


def _describe(path: str, probs: list[float], class_names: list[str]) -> dict:
    if not all(math.isfinite(p) for p in probs):  # max() would name the first class
        return {"path": path, "label": None, "prob": None, "probs": {}, "error": NOT_FINITE}
    best = max(range(len(probs)), key=probs.__getitem__)
    return {
        "path": path,
        "label": class_names[best],
        "prob": float(probs[best]),
        "probs": {name: float(p) for name, p in zip(class_names, probs)},
        "error": None,
    }
