"""Model files: a trained model saved with what it needs to be used again (architecture, class
names, input size, normalization), and loaded back with every field checked first."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import reprlib
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from modules.config import (IMAGENET_MEAN, IMAGENET_STD, MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, MODELS,
                            UserError, first_line)
from modules.device import library_device
from modules.files import atomic_torch_save, read_torch_file
from modules.models import build_model, is_run_checkpoint, strip_prefixes

log = logging.getLogger(__name__)

FORMAT_NAME = "imgcls-model"
FORMAT_VERSION = 1


def save_model(model: nn.Module, path, *, arch: str, class_names, image_size: int,
               mean=IMAGENET_MEAN, std=IMAGENET_STD, extra: dict | None = None) -> Path:
    """Write `model` with everything needed to rebuild and use it; returns the path written.

    The file holds only plain Python types and CPU tensors, so
    `torch.load(path, weights_only=True)` reads it without executing code.
    """
    path = Path(path)
    names = _check_class_names(class_names)
    # a numpy or 0-d tensor integer (TrainConfig takes one) as the int it is; a float stays
    # what it is, and is refused
    if not isinstance(image_size, (bool, float)):
        with contextlib.suppress(TypeError):  # a float tensor has __index__, which refuses
            image_size = operator.index(image_size)
    _check_meta(arch, image_size, mean, std)
    payload = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        # str(): numpy strings pass the checks, but weights_only loading refuses them
        "arch": str(arch),
        "num_classes": len(names),
        "class_names": [str(n) for n in names],
        "image_size": int(image_size),
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
        "state_dict": _cpu_state_dict(model),
        "extra": _json_roundtrip(extra),
    }
    # A file that load_model would refuse is not written.
    _check_state_dict_fits(payload, f"the model to save as {str(path)!r}")
    atomic_torch_save(payload, path)
    return path


def read_meta(path) -> dict:
    """The metadata of a model file written by `save_model` (load_model's `model.meta`), the
    file checked as load_model checks it, without building the model."""
    path = Path(path)
    payload = _read_payload(path)
    _check_state_dict_fits(payload, f"model file {str(path)!r}")
    return _meta(payload)


def load_model(path, device="cpu") -> nn.Module:
    """Rebuild a model written by `save_model`, in eval mode, with its metadata in `model.meta`."""
    path = Path(path)
    device = library_device(device)
    payload = _read_payload(path)
    _check_state_dict_fits(payload, f"model file {str(path)!r}")
    model = build_model(payload["arch"], payload["num_classes"], weights="none")
    try:
        model.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        first = first_line(exc)
        raise UserError(f"model file {str(path)!r} does not match architecture "
                        f"{payload['arch']!r}: {first}") from None
    model.to(device).eval()
    model.meta = _meta(payload)
    return model


def _meta(payload: dict) -> dict:
    return {
        "arch": payload["arch"],
        "class_names": list(payload["class_names"]),
        "image_size": payload["image_size"],
        "mean": tuple(payload["mean"]),
        "std": tuple(payload["std"]),
        "extra": payload.get("extra"),
    }


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


def _cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    if not isinstance(model, nn.Module):
        raise UserError(f"save_model needs a torch.nn.Module, but got {type(model).__name__}.")
    state = {}
    for key, tensor in _unwrap(model).state_dict().items():
        # clone: a CPU model's tensors would otherwise share storage with the live weights.
        state[strip_prefixes(key)] = tensor.detach().to("cpu", copy=True).contiguous()
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
        if is_run_checkpoint(payload):
            what = ("a run's checkpoint, which --resume continues from: the run's best model "
                    "is the <data set>_model.pt in its --output-dir, and pipeline.py --weights "
                    "PATH starts a new run from the checkpoint")
        else:
            what = ("a bare state_dict? pipeline.py --weights PATH starts a run from one; in "
                    "Python, model.load_state_dict(torch.load(PATH)) on a model of its "
                    "architecture")
        raise UserError(f"{str(path)!r} is not a model saved by save_model ({what}).")
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
        if not isinstance(payload.get("extra"), (dict, type(None))):
            raise UserError(f"extra must be a dict or absent, but got "
                            f"{_short(payload['extra'])}.")
        state = payload["state_dict"]
        if not (isinstance(state, dict) and state and all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())):
            raise UserError("state_dict must map parameter names to tensors, but got "
                            f"{_short(state)}.")
    except UserError as exc:
        raise UserError(f"model file {str(path)!r} is damaged: {exc}") from None
    # type(): 3.0 equals 3, but build_model cannot take it
    if type(payload["num_classes"]) is not int or \
            payload["num_classes"] != len(payload["class_names"]):
        raise UserError(f"{str(path)!r} has num_classes={_short(payload['num_classes'])} for "
                        f"{len(payload['class_names'])} class_names; the file is damaged.")
    return payload


def _check_state_dict_fits(payload: dict, what: str) -> None:
    """A model file's tensors (or a model's about to be saved, `what`) against the shapes its
    architecture and class count need, on the meta device: no memory is spent on a model the
    file cannot fill (its class count alone could ask for gigabytes)."""
    with torch.device("meta"):
        wanted = build_model(payload["arch"], payload["num_classes"], weights="none").state_dict()
    state = payload["state_dict"]
    problems = [f"missing {k}" for k in wanted if k not in state] + \
               [f"unexpected {_short(k)}" for k in state if k not in wanted] + \
               [f"{k} is {tuple(state[k].shape)}, not {tuple(v.shape)}"
                for k, v in wanted.items() if k in state and state[k].shape != v.shape]
    if problems:
        raise UserError(f"{what} does not match architecture "
                        f"{payload['arch']!r} with {payload['num_classes']} classes: "
                        f"{'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''}.")
