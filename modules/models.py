"""Model zoo: torchvision classifiers with their heads resized to the dataset's classes."""
from __future__ import annotations

import contextlib
import functools
import io
import os
import logging
import socket
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from modules.config import DROPOUT_IMPLS, MODELS, UserError, first_line
from modules.files import read_torch_file

log = logging.getLogger(__name__)

_WEIGHTS = {
    "squeezenet1_1": torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1,
    "resnet18": torchvision.models.ResNet18_Weights.IMAGENET1K_V1,
    "mobilenet_v3_small": torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1,
}


def build_model(name: str, num_classes: int, weights: str = "none",
                dropout_impl: str = "native") -> nn.Module:
    """A torchvision model with `num_classes` outputs.

    `weights`: "none" (random init), "imagenet" (torchvision's weights; downloaded once, then
    read from the torch hub cache; when unreachable, one warning line and random init), or the
    path of a state_dict / saved-model file whose matching tensors are loaded.
    `dropout_impl`: "native" (nn.Dropout) or "bytemask" (ByteMaskDropout, where it is exact).
    """
    if name not in MODELS:
        raise UserError(f"model must be one of {', '.join(MODELS)}, but got {name!r}.")
    if num_classes < 2:
        raise UserError(f"a classifier needs at least 2 classes, but got {num_classes}.")
    if dropout_impl not in DROPOUT_IMPLS:
        raise UserError(f"dropout_impl must be one of {', '.join(DROPOUT_IMPLS)}, but got "
                        f"{dropout_impl!r}.")
    model = getattr(torchvision.models, name)(weights=None)
    if weights == "imagenet":
        _load_imagenet(model, name)
    _replace_head(model, name, num_classes)
    path = weights_file(weights)
    if path is not None:
        # After the head is sized: a file for the same classes (a tuner's trial) loads whole;
        # one for other classes loads all but the head.
        _load_file(model, path, name)
    if dropout_impl == "bytemask":
        _use_bytemask_dropout(model)
    for module in model.modules():
        # torchvision's MobileNetV3 keeps BatchNorm's running statistics at momentum 0.01
        # (its ImageNet recipe trains 600 epochs). In runs of a few hundred steps they lag
        # the weights so far that evaluation, which uses them, scores chance while training
        # learns (docs/training.md): PyTorch's default, ResNet's, follows them.
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is not None:
            module.momentum = max(module.momentum, BN_MOMENTUM)
    return model


BN_MOMENTUM = 0.1  # the least running-statistics momentum a BatchNorm layer trains with


def weights_file(weights: str | None) -> Path | None:
    """The file a `weights` setting names, or None for "none" and "imagenet"."""
    return None if weights in ("none", "imagenet", None) else Path(weights)


# ----------------------------------------------------------------------------- dropout

BYTE_LEVELS = 256  # a byte mask keeps an element when its random byte is >= p * 256


class ByteMaskDropout(nn.Dropout):
    """nn.Dropout with the same masks in distribution, drawn faster: each element keeps with
    probability 1 - p and is scaled by 1 / (1 - p), as in F.dropout, but its keep decision is a
    random byte compared with p * 256, four bytes to a 32-bit draw (for p = 0.5, a random bit:
    32 to a draw).

    PyTorch's CPU bernoulli_ draws a double per element, a noticeable share of a CPU training
    step for SqueezeNet (docs/speed.md); a byte per element is several times cheaper. It is
    exact only for a p that is a multiple of 1/256 (SqueezeNet's 0.5); models.py swaps in no
    other. An in-place or
    non-training call is F.dropout's."""

    @staticmethod
    def applies(p: float) -> bool:
        return 0.0 < p < 1.0 and float(p * BYTE_LEVELS).is_integer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.inplace or not self.applies(self.p):
            return F.dropout(x, self.p, self.training, self.inplace)
        n = x.numel()
        if self.p == 0.5:  # one random bit per element, 32 to a draw
            words = _random_words((n + 31) // 32, x.device).view(torch.uint8)
            shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
            keep = words.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)[:n]
        else:
            keep = _random_words((n + 3) // 4, x.device).view(torch.uint8)[:n] \
                >= int(self.p * BYTE_LEVELS)
        # The mask takes x's strides when x is dense (channels_last included), so the multiply
        # below walks both in the same order; random bits in any order are the same mask.
        dense = x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(
            memory_format=torch.channels_last))
        stride = x.stride() if dense else torch.empty(x.shape, device="meta").stride()
        return x * keep.as_strided(x.shape, stride).to(x.dtype).mul_(1.0 / (1.0 - self.p))


def _random_words(n: int, device: torch.device) -> torch.Tensor:
    """n uniformly random 32-bit words, from torch's generator (seeded like F.dropout's)."""
    return torch.randint(-2**31, 2**31, (n,), dtype=torch.int32, device=device)


def _use_bytemask_dropout(model: nn.Module) -> int:
    """Swap every nn.Dropout whose p ByteMaskDropout draws exactly; returns how many."""
    swapped = 0
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Dropout and ByteMaskDropout.applies(child.p):
                setattr(parent, name, ByteMaskDropout(child.p, child.inplace))
                swapped += 1
    return swapped


@functools.lru_cache(maxsize=None)
def has_bytemask_dropout(name: str) -> bool:
    """Whether the model has a dropout layer that "bytemask" would change."""
    return _use_bytemask_dropout(build_model(name, 2, "none")) > 0


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


def num_classes_of(model: nn.Module) -> int:
    """The class count build_model gave `model`."""
    n = getattr(model, "num_classes", None)
    if n is None:
        raise UserError("the model has no num_classes attribute; build it with "
                        "modules.models.build_model.")
    return int(n)


_UNREACHABLE: set[str] = set()  # models whose weights failed to download in this process
_TRIED: set[str] = set()  # models whose weights this process has tried to load
_KEPT_RANDOM: set[str] = set()  # in _UNREACHABLE for the resumed run alone (keep_random_start)
UNREACHABLE_START = "random (ImageNet weights unreachable)"
FETCH_TIMEOUT_S = 60.0  # seconds a download may wait for the server before it counts as failed


def start_weights(name: str, weights: str) -> str:
    """What a run asked to start from (`weights`, as the user gave it) actually was: the
    ImageNet weights, or a random start when they could not be fetched in this process (or in
    the session of the run it resumes: keep_random_start)."""
    if weights == "imagenet" and name in _UNREACHABLE:
        return UNREACHABLE_START
    return weights


def possible_starts(name: str, weights: str) -> set[str]:
    """What start_weights may say of this process's runs: before it has tried to fetch the
    ImageNet weights, either what was asked for or the random start of their being
    unreachable."""
    if weights == "imagenet" and name not in _TRIED:
        return {weights, UNREACHABLE_START}
    return {start_weights(name, weights)}


def resolved_start(name: str, weights: str) -> str:
    """start_weights() for a run about to start: the ImageNet weights are tried now (read from
    the hub cache, or fetched) when this process has not tried them yet."""
    if weights == "imagenet" and name in _WEIGHTS and name not in _TRIED:
        _load_imagenet(getattr(torchvision.models, name)(weights=None), name)
    return start_weights(name, weights)


def keep_random_start(name: str | None) -> None:
    """The run being resumed started its `name` models at random (the ImageNet weights were
    unreachable in its first session): this one's start there too, reachable or not, as if
    unreachable in this process. None: a run starting, whose start is its own: the weights are
    tried again, also where an earlier run of this process could not fetch them (a network
    blip before a second Run all in the notebook; it said so once, and this run would not)."""
    if name is None:
        _UNREACHABLE.clear()
        _TRIED.clear()
        _KEPT_RANDOM.clear()
    elif name not in _UNREACHABLE:  # else unreachable here too, and said so already
        _KEPT_RANDOM.add(name)
        _UNREACHABLE.add(name)


def _load_imagenet(model: nn.Module, name: str) -> None:
    _TRIED.add(name)
    if name in _UNREACHABLE:  # said once already (or kept random); tuners build many models
        return
    weights = _WEIGHTS[name]
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    aside = None
    try:
        try:
            state = _fitting(model, _fetch(weights))
        except Exception:
            if not cached.is_file():
                raise
            # torch.hub never downloads a file it has again: a torn or damaged copy (a
            # disconnect mid-download), or another file under its name, would fail every run.
            # Kept aside, fetched once more.
            aside = cached.with_name(cached.name + ".unreadable")
            os.replace(cached, aside)
            state = _fitting(model, _fetch(weights))
    except Exception as exc:  # offline, proxy, corrupt cache: training from scratch still works
        reason = first_line(exc)
        if isinstance(exc, RuntimeError) and "invalid hash value" in reason:
            # Not a failure to train around: what arrived is not torchvision's file.
            raise UserError(f"the ImageNet weights downloaded for {name} do not match their "
                            f"published hash ({reason}); nothing was kept. Retry, or use "
                            "--weights none or --weights PATH.") from None
        _UNREACHABLE.add(name)
        log.warning("ImageNet weights for %s could not be fetched (%s)%s; training from random "
                    "initialization. Use --weights none to silence this, or --weights PATH.",
                    name, reason, "" if aside is None else
                    f"; the cached copy could not be read and is kept aside as {aside}")
        return
    model.load_state_dict(state)
    log.info("loaded ImageNet weights for %s%s", name, "" if aside is None else
             f" (downloaded again: the cached copy could not be read, kept aside as {aside})")


def _fitting(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state`, when its names and shapes are `model`'s; else ValueError, before any tensor is
    copied (load_state_dict copies those that match, then raises). BatchNorm's step counters
    are left out: files saved before PyTorch had them (torchvision's ResNet weights) lack
    them, and load_state_dict fills them in."""
    def counted(names):
        return {k for k in names if not k.endswith("num_batches_tracked")}
    own = model.state_dict()
    if counted(own) != counted(state) or any(own[k].shape != state[k].shape
                                             for k in counted(own)):
        raise ValueError("the file holds weights of another architecture")
    return state


def _fetch(weights) -> dict[str, torch.Tensor]:
    """torchvision's weights, from torch.hub's cache or downloaded into it. torch.hub prints
    a "Downloading ..." line even with progress off; the console keeps to _load_imagenet's one
    line when it fails. The file name carries the start of its SHA-256, which check_hash
    verifies on download; weights_only reads it without running code."""
    # A connection that opens and then stalls (a proxy) would block the run for ever, with
    # nothing said: a stall of FETCH_TIMEOUT_S fails like being offline.
    timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(FETCH_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return weights.get_state_dict(progress=False, check_hash=True, weights_only=True)
    finally:
        socket.setdefaulttimeout(timeout)


def strip_prefixes(key: str) -> str:
    """A state_dict key without the prefixes a wrapper adds (torch.compile's `_orig_mod.`,
    DataParallel's and DDP's `module.`): build_model's plain module has none."""
    changed = True
    while changed:
        changed = False
        for prefix in ("_orig_mod.", "module."):
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


_PINNED: dict[Path, object] = {}  # the running run's --weights file, as read at its start


@contextlib.contextmanager
def pinned_weights_file(path: Path | None):
    """The run's --weights file (None: none), read once as it starts and used for every model
    it builds: read again for each, a file another run saved over (its best model, say) would
    start this run's later scenarios and trials from other weights under the same name."""
    _PINNED.clear()
    if path is not None:
        _PINNED[Path(path).expanduser().resolve()] = read_torch_file(path, "weights file")
    try:
        yield
    finally:
        _PINNED.clear()


def pinned_file(path: Path | None):
    """What the run's --weights file held as pinned_weights_file read it (None: none)."""
    return None if path is None else _PINNED.get(Path(path).expanduser().resolve())


def is_run_checkpoint(state) -> bool:
    """Whether a torch file holds a run's checkpoint (checkpoints/<run>/<scenario>.pt: its
    model, config, optimizer ...), rather than a model's weights."""
    return isinstance(state, dict) and isinstance(state.get("model"), dict) and "config" in state


# Where a checkpoint keeps its model's tensors: this tool's model files and Lightning's
# ("state_dict"), the PyTorch tutorial's ("model_state_dict"), torchvision's reference
# scripts' ("model").
WRAPPED = ("state_dict", "model_state_dict", "model")


def _fitting_tensors(model: nn.Module, path: Path, name: str | None = None
                     ) -> dict[str, torch.Tensor]:
    """The tensors of a weights file that fit `model` (torchvision's `name`); a file that is
    not PyTorch's, of which nothing fits, or that holds more than this model (a deeper one of
    its family), is refused in one line."""
    state = pinned_file(path)
    if state is None:  # not the run's pinned --weights (a check before the run starts)
        state = read_torch_file(path, "weights file")
    arch = state.get("arch") if isinstance(state, dict) else None
    if name and arch in MODELS and arch != name and isinstance(state.get("state_dict"), dict):
        raise UserError(f"--weights: {str(path)!r} holds a {arch} model, not {name}: pass "
                        f"--model {arch} to start from it.")
    if is_run_checkpoint(state):
        # a run's checkpoint (checkpoints/<run>/<scenario>.pt): the model the run ends with,
        # its best validation epoch's, not its last epoch's
        best = state.get("best")
        state = best["state"] if isinstance(best, dict) and isinstance(best.get("state"), dict) \
            else state["model"]
    elif isinstance(state, dict):
        state = next((state[key] for key in WRAPPED if isinstance(state.get(key), dict)), state)
    if not isinstance(state, dict):
        raise UserError(f"--weights: {str(path)!r} does not hold a state_dict.")
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        keys = sorted(map(str, state))
        raise UserError(f"--weights: {str(path)!r} holds no tensor by name (its keys: "
                        f"{', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}): save the "
                        "model's state_dict(), torch.save(model.state_dict(), path).")
    own = model.state_dict()
    state = _named_as_own(tensors, own, path)
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise UserError(f"--weights: no tensor in {str(path)!r} fits this model; is it another "
                        "architecture?")
    # The head may have another class count; every other tensor must fit, or the file is
    # another architecture whose tensors fit only here and there by shape.
    head = set(_head_keys(model))
    missing = [k for k in own if k not in usable and k not in head and _learned(own[k])]
    if missing:
        raise UserError(f"--weights: {str(path)!r} does not fit this model: {len(missing)} of "
                        f"its tensors are missing or another shape (first: {missing[0]}); is it "
                        "another architecture?")
    # ResNet-34's names include all of ResNet-18's, at their shapes: its further blocks
    # would be dropped without a word. A classifier of other layers (fc as Dropout and
    # Linear, a fine-tuning recipe's) starts new as any other head does.
    top = next(iter(head)).split(".", 1)[0] + "."
    extra = [k for k, v in state.items() if k not in own and _learned(v)
             and not k.startswith(top)]
    if extra:
        raise UserError(f"--weights: {str(path)!r} does not fit this model: {len(extra)} of the "
                        f"file's tensors have no place in it (first: {extra[0]}); is it another "
                        "architecture (a deeper one of its family)?")
    return usable


def _named_as_own(tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor],
                  path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors by `own`'s names: without the prefixes a wrapper adds, and where
    more of them fit so, only those under one prefix, without it (a LightningModule's
    `model.`; its metrics' or loss's tensors beside them are not the model's)."""
    def fitting(state: dict[str, torch.Tensor]) -> int:
        return sum(k in own and own[k].shape == v.shape for k, v in state.items())
    plain = {strip_prefixes(k): v for k, v in tensors.items()}
    under = {prefix: {strip_prefixes(k[len(prefix):]): v for k, v in plain.items()
                      if k.startswith(prefix)}
             for prefix in sorted({k.split(".", 1)[0] + "." for k in plain if "." in k})}
    fits = {prefix: fitting(state) for prefix, state in under.items()}
    most = max(fits.values(), default=0)
    if most <= fitting(plain):
        return plain
    best = [prefix for prefix, n in fits.items() if n == most]
    if len(best) > 1:  # MoCo's encoder_q and encoder_k, a model and its EMA copy
        raise UserError(f"--weights: {str(path)!r} holds this model {len(best)} times (under "
                        f"{', '.join(best)}): save the one to start from on its own, "
                        "torch.save(state_dict, path).")
    return under[best[0]]


def _head_keys(model: nn.Module) -> list[str]:
    """The state_dict keys of the classification layer: the last module with parameters."""
    last = [name for name, m in model.named_modules() if next(m.parameters(recurse=False), None)
            is not None][-1]
    return [f"{last}.{k}" for k, _ in model.get_submodule(last).named_parameters(recurse=False)]


def _learned(tensor: torch.Tensor) -> bool:
    """A weight or running statistic; not a counter such as BatchNorm's num_batches_tracked,
    which a file written elsewhere may leave out."""
    return tensor.is_floating_point()


def check_weights_file(name: str, path: Path) -> None:
    """Refuses a --weights file this model cannot use before a run starts."""
    _fitting_tensors(getattr(torchvision.models, name)(weights=None), path, name)


def _load_file(model: nn.Module, path: Path, name: str) -> None:
    usable = _fitting_tensors(model, path, name)
    model.load_state_dict(usable, strict=False)
    fresh = [k for k in _head_keys(model) if k not in usable]
    log.info("loaded %d of %d tensors from %s%s", len(usable), len(model.state_dict()), path,
             f"; the classifier ({fresh[0].rsplit('.', 1)[0]}) starts new, for "
             f"{num_classes_of(model)} classes" if fresh else "")
