"""Model zoo: torchvision classifiers with their heads resized to the dataset's classes."""
from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import torchvision
from torch import nn

from modules.config import MODELS, UserError
from modules.files import read_torch_file

log = logging.getLogger(__name__)

_WEIGHTS = {
    "squeezenet1_1": torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1,
    "resnet18": torchvision.models.ResNet18_Weights.IMAGENET1K_V1,
    "mobilenet_v3_small": torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1,
}


def build_model(name: str, num_classes: int, weights: str = "none") -> nn.Module:
    """A torchvision model with `num_classes` outputs.

    `weights`: "none" (random init), "imagenet" (torchvision's weights; downloaded once, then
    read from the torch hub cache; when unreachable, one warning line and random init), or the
    path of a state_dict / saved-model file whose matching tensors are loaded.
    """
    if name not in MODELS:
        raise UserError(f"model must be one of {', '.join(MODELS)}, but got {name!r}.")
    if num_classes < 2:
        raise UserError(f"a classifier needs at least 2 classes, but got {num_classes}.")
    model = getattr(torchvision.models, name)(weights=None)
    if weights == "imagenet":
        _load_imagenet(model, name)
    elif weights not in ("none", None):
        _load_file(model, Path(weights))
    _replace_head(model, name, num_classes)
    return model


def _replace_head(model: nn.Module, name: str, num_classes: int) -> None:
    if name == "squeezenet1_1":
        # SqueezeNet classifies with a 1x1 conv (torchvision initialises it with std 0.01).
        # Its original head puts a ReLU after that conv: from random init a few Adam steps can
        # push every class score below zero, the logits go flat at 0 and the loss sticks at
        # ln(N) for good (seen on the synthetic set). Without the ReLU the logits stay live.
        conv = nn.Conv2d(512, num_classes, kernel_size=1)
        nn.init.normal_(conv.weight, mean=0.0, std=0.01)
        nn.init.zeros_(conv.bias)
        model.classifier = nn.Sequential(model.classifier[0], conv, nn.AdaptiveAvgPool2d(1))
    elif name == "resnet18":
        model.fc = nn.Linear(model.fc.in_features, num_classes)
    elif name == "mobilenet_v3_small":
        last = model.classifier[-1]
        model.classifier[-1] = nn.Linear(last.in_features, num_classes)
    model.num_classes = num_classes


_UNREACHABLE: set[str] = set()  # models whose weights failed to download in this process


def _load_imagenet(model: nn.Module, name: str) -> None:
    if name in _UNREACHABLE:  # said once already; tuners build many models
        return
    weights = _WEIGHTS[name]
    try:
        # torch.hub prints a "Downloading ..." line even with progress off; keep the console to
        # the one line below when it fails.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state = weights.get_state_dict(progress=False, check_hash=False)
    except Exception as exc:  # offline, proxy, corrupt cache: training from scratch still works
        _UNREACHABLE.add(name)
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        log.warning("ImageNet weights for %s could not be fetched (%s); training from random "
                    "initialization. Use --weights none to silence this, or --weights PATH.",
                    name, reason)
        return
    model.load_state_dict(state)
    log.info("loaded ImageNet weights for %s", name)


def _load_file(model: nn.Module, path: Path) -> None:
    state = read_torch_file(path, "weights file")
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a file written by modules.utility.save_model
    if not isinstance(state, dict):
        raise UserError(f"--weights: {str(path)!r} does not hold a state_dict.")
    own = model.state_dict()
    # The head may have another class count; every other tensor must fit.
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise UserError(f"--weights: no tensor in {str(path)!r} fits this model; is it another "
                        "architecture?")
    model.load_state_dict(usable, strict=False)
    log.info("loaded %d of %d tensors from %s", len(usable), len(own), path)
