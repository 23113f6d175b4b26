"""What the device can hold: a memory probe that fits peak training memory against batch size."""
from __future__ import annotations

import dataclasses
import logging

import torch

from modules.config import TrainConfig, UserError
from modules.models import build_model
from modules.oom import MEMORY_MARGIN, is_out_of_memory, release
from modules.device import autocast_dtype
from modules.trainer import make_optimizer, train_step

log = logging.getLogger(__name__)

PROBE_BATCHES = (4, 16)  # two small batches; memory grows linearly in the batch size
# The autotuner's probe asks up to the search's largest batch (optuna_optimizer.BATCH_SIZES),
# so that the hpo scenario reads its bound from that probe instead of probing again.
PROBE_UPTO = 256


def step_peak_bytes(config: TrainConfig, num_classes: int, batch_size: int,
                    device: torch.device) -> int:
    """Peak CUDA memory of one training step plus an eval forward at `batch_size`."""
    model = build_model(config.model, num_classes, "none", config.dropout_impl).to(device)
    memory_format = torch.channels_last if config.channels_last else torch.contiguous_format
    model.to(memory_format=memory_format)
    # The trainer's optimizer with Adam-style state, the largest of ours, so the batch found
    # fits every optimizer a search may pick.
    optimizer = make_optimizer(model, dataclasses.replace(config, optimizer="adamw"), device)
    x = torch.randn(batch_size, 3, config.image_size, config.image_size, device=device)
    x = x.to(memory_format=memory_format)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    dtype = autocast_dtype(config.amp, device)
    amp = dtype is not None
    # Scale 1: at the default 65536 SqueezeNet's first fp16 step from random weights
    # overflows, the scaler skips optimizer.step() and its state would go unmeasured.
    scaler = torch.amp.GradScaler("cuda", init_scale=1.0, enabled=dtype == torch.float16)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    train_step(model, model, optimizer, scaler, x, y, device=device, dtype=dtype,
               max_grad_norm=config.max_grad_norm)
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype or torch.float32, enabled=amp):
        model(x)
    peak = torch.cuda.max_memory_allocated(device)
    del model, optimizer, x, y
    torch.cuda.empty_cache()
    return peak


def max_batch_size(config: TrainConfig, num_classes: int, device: torch.device, *,
                   upto: int | None = None, margin: float = MEMORY_MARGIN) -> int | None:
    """The largest batch whose step fits in `margin` of the GPU's memory: a straight line
    through two probes, checked by a third; None on CPU, where RAM is not what limits these
    models. `upto`: the largest batch the caller would use (the check probes no further)."""
    if device.type != "cuda":
        return None
    # Each probed batch is a new shape, and cuDNN's algorithm search takes seconds per shape;
    # the trials these batches are for run without it too (TrainConfig.as_trial).
    searching = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        return _max_batch_size(config, num_classes, device, upto, margin)
    finally:
        torch.backends.cudnn.benchmark = searching


def _probe(config: TrainConfig, num_classes: int, batch_size: int, device: torch.device
           ) -> int | None:
    """step_peak_bytes, or None when that step ran out of memory (the memory released)."""
    try:
        return step_peak_bytes(config, num_classes, batch_size, device)
    except RuntimeError as exc:  # torch's OutOfMemoryError, or "CUDA error: out of memory"
        if not is_out_of_memory(exc):
            raise
    release(device)  # outside the except block, whose traceback holds the probe's tensors
    return None


def _largest_fitting(peak, fits: int, over: int, budget: float) -> int:
    """The largest batch from `fits` (known to fit; 0: none known) below `over` (known not
    to), by bisection: a few probes, each a new shape. A step fits when it takes at most
    `budget` bytes: the rest of the memory is planned for the decoded-image cache.
    peak: a batch size's step peak in bytes, None when it ran out of memory."""
    while over - fits > 1:
        middle = (fits + over) // 2
        bytes_ = peak(middle)
        if bytes_ is None or bytes_ > budget:
            over = middle
        else:
            fits = middle
    return fits


def _max_batch_size(config: TrainConfig, num_classes: int, device: torch.device,
                    upto: int | None, margin: float) -> int:
    small, large = PROBE_BATCHES
    if upto is not None:  # never a probe past what the caller would use
        small, large = min(small, upto), min(large, upto)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = margin * total
    peaks: dict[int, int | None] = {}

    def peak(batch_size: int) -> int | None:
        if batch_size not in peaks:
            peaks[batch_size] = _probe(config, num_classes, batch_size, device)
        return peaks[batch_size]
    low = peak(small)
    if low is None or low > budget:  # fewer images than the smallest probe
        fits = _largest_fitting(peak, 0, small, budget)
        if fits < 1:
            if peak(1) is None:
                free, whole = torch.cuda.mem_get_info(device)
                raise UserError(f"a training step of 1 image at {config.image_size} px does "
                                f"not fit in the GPU's memory ({free / 2**20:.0f} MB free of "
                                f"{whole / 2**20:.0f} MB): use a smaller --image-size, or "
                                "free the GPU.")
            log.warning("memory probe at %d px: a step of 1 image takes more than %.0f%% of "
                        "the GPU's %.0f MB, which leaves the decoded-image cache little room; "
                        "a smaller --image-size leaves more", config.image_size, 100 * margin,
                        total / 2**20)
            return 1
        log.info("memory probe at %d px: a step of %d images does not fit in %.0f%% of the "
                 "GPU's memory; %d do", config.image_size, fits + 1, 100 * margin, fits)
        return fits
    if large == small:
        return small
    high = peak(large)
    if high is None or high > budget:  # between the two probes
        fits = _largest_fitting(peak, small, large, budget)
        log.info("memory probe at %d px: a step of %d images does not fit in %.0f%% of the "
                 "GPU's memory; %d do", config.image_size, fits + 1, 100 * margin, fits)
        return fits
    per_sample = max(1.0, (high - low) / (large - small))
    fixed = low - per_sample * small
    fits = max(1, int((budget - fixed) / per_sample))
    if upto is not None:
        fits = min(fits, upto)
    # Large batches can pick cuDNN algorithms with bigger workspaces than the line predicts:
    # a third probe at the prediction bisects down to the probe that fit when it ran out of
    # memory, and when it overshot, takes the smaller of two readings of the overshoot: a
    # larger fixed part (a workspace) at the same cost an image, or a steeper cost an image
    # through the first probe. Scaling the batch alone would leave the fixed part over the
    # budget.
    if fits > large:
        third = peak(fits)
        if third is None:
            fits = _largest_fitting(peak, large, fits, budget)
        elif third > budget:
            fixed_more = third - per_sample * fits
            steeper = max(1.0, (third - low) / (fits - small))
            fits = max(1, min(int((budget - fixed_more) / per_sample),
                              int((budget - (low - steeper * small)) / steeper)))
    log.info("memory probe at %d px: %.1f MB per sample, %.0f MB fixed; up to batch %d fits in "
             "%.0f%% of %.0f MB", config.image_size, per_sample / 2**20, fixed / 2**20, fits,
             100 * margin, total / 2**20)
    return fits
