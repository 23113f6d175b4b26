"""The one training configuration object, and the error type for user mistakes."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

# ImageNet channel statistics (RGB, 0-1 scale): torchvision's pretrained weights expect them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

MODELS = ("squeezenet1_1", "resnet18", "mobilenet_v3_small")
# Smallest input side, pixels, whose feature map survives each model's downsampling.
MIN_IMAGE_SIZE = {"squeezenet1_1": 17, "resnet18": 16, "mobilenet_v3_small": 16}
MAX_IMAGE_SIZE = 2048  # largest input side, pixels: training's and a model file's
MAX_SEED = 2**32 - 1  # the samplers derive their generators' seeds from it, within 64 bits
# Models whose BatchNorm, in training, needs more than one value per channel: up to this input
# side their last feature map is 1x1, so a single-image batch cannot train.
BATCHNORM_MODELS_ONE_PIXEL_UP_TO = {"resnet18": 32, "mobilenet_v3_small": 32}
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULERS = ("cosine", "onecycle", "none")
AMP_MODES = ("auto", "off", "fp16", "bf16")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "forloop")
CPU_ALLOCATORS = ("system", "retain")  # modules.hostmem
DROPOUT_IMPLS = ("native", "bytemask")  # modules.models.ByteMaskDropout


# TrainConfig fields that only change what is shown (a saved autotune or tuning result made
# with progress bars holds for a run without them).
DISPLAY_ONLY = frozenset({"progress"})
# TrainConfig's speed knobs: how fast a run goes, not what it learns. The autotuner measures them
# for each scenario and size, so a trial's weights are continued under other values.
SPEED_ONLY = frozenset({"amp", "channels_last", "compile", "optimizer_impl", "cpu_threads",
                        "cpu_allocator", "dropout_impl", "cache_decoded", "cudnn_benchmark",
                        "num_workers", "pin_memory", "persistent_workers", "prefetch_factor"})
# TrainConfig fields that change what a run learns but not how fast a step runs: a speed
# measured under other values of these holds (autotune's cache and reuse).
LEARNING_ONLY = frozenset({"weights", "epochs", "lr", "weight_decay", "momentum", "scheduler",
                           "warmup_epochs", "early_stopping_patience", "max_nonfinite_steps",
                           "seed"}) | DISPLAY_ONLY


class UserError(Exception):
    """A mistake in the user's input: the command prints its message as one line, no traceback."""


def first_line(exc: BaseException, limit: int = 120) -> str:
    """An exception's first non-empty line, at most `limit` characters, "..." marking a cut (its
    type's name when it has no message): what a one-line error quotes of it."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines[0]) <= limit else lines[0][:max(0, limit - 3)] + "..."


# The loader settings of a run that starts no DataLoader worker (the decoded-image cache
# makes its batches in the training process).
NO_WORKERS = {"num_workers": 0, "persistent_workers": False, "prefetch_factor": None}


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs. Variants come from `dataclasses.replace`."""

    # model
    model: str = "squeezenet1_1"
    weights: str = "imagenet"          # "none", "imagenet" or a path to a state_dict / saved model
    image_size: int = 150              # square input side, pixels
    # optimisation
    epochs: int = 10
    batch_size: int = 32               # samples per micro-batch (one forward/backward)
    grad_accum_steps: int = 1          # micro-batches per optimizer step; effective batch = product
    lr: float = 1e-3                   # peak learning rate, per optimizer step
    weight_decay: float = 0.0
    momentum: float = 0.9              # SGD only
    optimizer: str = "adam"
    scheduler: str = "cosine"          # stepped once per optimizer step
    warmup_epochs: float = 0.0         # linear ramp of the lr before cosine/constant (onecycle has its own)
    max_grad_norm: float | None = None  # clip the global L2 norm of gradients; None = no clipping
    early_stopping_patience: int | None = None  # epochs without a better val accuracy; None = off
    max_nonfinite_steps: int = 5       # NaN/inf batches with no update between them before giving up
    # speed knobs
    amp: str = "off"                   # "auto" picks fp16 (CUDA) / bf16 (CUDA sm80+) / off (CPU)
    channels_last: bool = False
    compile: bool = False
    optimizer_impl: str = "auto"       # "auto": fused on CUDA, PyTorch's default elsewhere
    cpu_threads: int | None = None     # torch intra-op threads; None = PyTorch's default
    cpu_allocator: str = "system"      # "retain": freed memory stays for reuse (hostmem.py)
    dropout_impl: str = "native"       # "bytemask": dropout masks from random bytes (models.py)
    cache_decoded: bool = False        # decode+resize once into a uint8 cache, augment in batches
    cudnn_benchmark: bool = True
    num_workers: int = 0               # DataLoader worker processes
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None  # batches prefetched per worker; None = PyTorch's default
    # bookkeeping
    seed: int = 42
    device: str = "auto"               # "auto", "cpu" or "cuda"
    progress: bool = True              # tqdm bars

    def __post_init__(self) -> None:
        # A checkpoint holds the config, and torch.load(weights_only=True) reads back builtin
        # types only: an lr from np.logspace or a Path for weights would make it unreadable.
        for f in dataclasses.fields(self):
            value = _plain(getattr(self, f.name))
            if value is not None and type(value) not in (bool, int, float, str):
                raise UserError(f"{f.name} must be {f.type}, but got {type(value).__name__} "
                                f"{value!r}.")
            object.__setattr__(self, f.name, value)
        if not isinstance(self.weights, str):
            raise UserError(f"weights must be 'none', 'imagenet' or a file's path, but got "
                            f"{self.weights!r}.")
        _choice("model", self.model, MODELS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("scheduler", self.scheduler, SCHEDULERS)
        _choice("amp", self.amp, AMP_MODES)
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _choice("cpu_allocator", self.cpu_allocator, CPU_ALLOCATORS)
        _choice("dropout_impl", self.dropout_impl, DROPOUT_IMPLS)
        if self.cpu_threads is not None:
            _positive_int("cpu_threads", self.cpu_threads, high=1024)
        if isinstance(self.image_size, int) and not isinstance(self.image_size, bool) and \
                0 < self.image_size < MIN_IMAGE_SIZE[self.model]:
            raise UserError(f"image_size {self.image_size} is too small for {self.model}: its "
                            f"layers need at least {MIN_IMAGE_SIZE[self.model]} pixels.")
        _positive_int("image_size", self.image_size, low=MIN_IMAGE_SIZE[self.model],
                      high=MAX_IMAGE_SIZE)
        _positive_int("epochs", self.epochs, high=100_000)
        _positive_int("batch_size", self.batch_size, high=1 << 20)
        _positive_int("grad_accum_steps", self.grad_accum_steps, high=1 << 16)
        _positive_int("max_nonfinite_steps", self.max_nonfinite_steps, high=1 << 20)
        _positive_float("lr", self.lr)
        if not (isinstance(self.warmup_epochs, (int, float)) and not isinstance(self.warmup_epochs, bool)
                and math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise UserError(f"warmup_epochs must be a finite number >= 0, but got {self.warmup_epochs=}.")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0):
            raise UserError(f"weight_decay must be a finite number >= 0, but got {self.weight_decay=}.")
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)) or \
                not (0 <= self.momentum < 1):
            raise UserError(f"momentum must be in [0, 1), but got {self.momentum=}.")
        if self.max_grad_norm is not None:
            _positive_float("max_grad_norm", self.max_grad_norm)
        if self.early_stopping_patience is not None:
            _positive_int("early_stopping_patience", self.early_stopping_patience, high=100_000)
        if not (isinstance(self.num_workers, int) and 0 <= self.num_workers <= 256):
            raise UserError(f"num_workers must be an integer in 0..256, but got {self.num_workers=}.")
        if self.prefetch_factor is not None:
            _positive_int("prefetch_factor", self.prefetch_factor, high=1024)
            if self.num_workers == 0:
                raise UserError("prefetch_factor needs num_workers > 0.")
        if self.persistent_workers and self.num_workers == 0:
            raise UserError("persistent_workers needs num_workers > 0.")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"seed must be an integer in 0..{MAX_SEED}, but got {self.seed=}.")
        if self.batch_size == 1 and self.image_size <= BATCHNORM_MODELS_ONE_PIXEL_UP_TO.get(
                self.model, 0):
            raise UserError(f"batch_size 1 cannot train {self.model} at {self.image_size} px: "
                            "its BatchNorm needs more than one value per channel; use a batch "
                            f"of 2 or more, or an image size above "
                            f"{BATCHNORM_MODELS_ONE_PIXEL_UP_TO[self.model]}.")

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size * self.grad_accum_steps

    def as_trial(self, **changes: Any) -> TrainConfig:
        """This config for a short tuning trial, with `changes`. No cuDNN algorithm search: on
        a GPU it takes seconds for each new input shape, every size or batch a tuner tries is
        one, and a run of a few epochs does not win that back. The final run searches for its
        one shape. No early stopping: trials are compared at the epochs they were given, and
        the tuners stop the ones clearly behind."""
        return dataclasses.replace(self, cudnn_benchmark=False, early_stopping_patience=None,
                                   **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def run_settings(self) -> dict[str, Any]:
        """to_dict() without the fields that change nothing a run computes or how fast
        (DISPLAY_ONLY): what a saved result is matched against before it is reused."""
        return {k: v for k, v in self.to_dict().items() if k not in DISPLAY_ONLY}

    def learning_settings(self) -> dict[str, Any]:
        """run_settings() without the speed knobs (SPEED_ONLY): what decides what a run learns,
        which a trial's weights must share to be continued by another run."""
        return {k: v for k, v in self.run_settings().items() if k not in SPEED_ONLY}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# Each setting's default: what a result or checkpoint from a version without it had.
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _plain(value: Any) -> Any:
    """`value` as the builtin type it stands for: a numpy number or string, or a path's text."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} must be one of {', '.join(allowed)}, but got {value!r}.")


def _positive_int(name: str, value: Any, *, low: int = 1, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise UserError(f"{name} must be an integer in {low}..{high}, but got {name}={value!r}.")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise UserError(f"{name} must be a finite number > 0, but got {name}={value!r}.")
