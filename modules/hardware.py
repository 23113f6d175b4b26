"""What the device can hold: a memory probe that fits peak training memory against batch size."""
from __future__ import annotations

import dataclasses
import logging

import torch

from modules.config import TrainConfig, UserError
from modules.models import build_model
from modules.oom import MEMORY_MARGIN, is_out_of_memory, release
from modules.trainer import autocast_dtype, make_optimizer, train_step

log = logging.getLogger(__name__)

PROBE_BATCHES = (4, 16)  # two small batches; memory grows linearly in the batch size


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
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
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


def _max_batch_size(config: TrainConfig, num_classes: int, device: torch.device,
                    upto: int | None, margin: float) -> int:
    small, large = PROBE_BATCHES
    low = _probe(config, num_classes, small, device)
    if low is None:
        free, total = torch.cuda.mem_get_info(device)
        raise UserError(f"a training step of {small} images at {config.image_size} px does not "
                        f"fit in the GPU's memory ({free / 2**20:.0f} MB free of "
                        f"{total / 2**20:.0f} MB): use a smaller --image-size, or free the GPU.")
    high = _probe(config, num_classes, large, device)
    if high is None:
        log.info("memory probe at %d px: a step of %d images does not fit; %d do",
                 config.image_size, large, small)
        return small if upto is None else min(small, upto)
    per_sample = max(1.0, (high - low) / (large - small))
    fixed = low - per_sample * small
    total = torch.cuda.get_device_properties(device).total_memory
    fits = max(1, int((margin * total - fixed) / per_sample))
    if upto is not None:
        fits = min(fits, upto)
    # Large batches can pick cuDNN algorithms with bigger workspaces than the line predicts:
    # a third probe at the prediction scales it down when it overshoots (far over: halve).
    peak = _probe(config, num_classes, fits, device)
    if peak is None:
        peak = 2 * margin * total
    if peak > margin * total:
        fits = max(1, int(fits * margin * total / peak))
    log.info("memory probe at %d px: %.1f MB per sample, %.0f MB fixed; up to batch %d fits in "
             "%.0f%% of %.0f MB", config.image_size, per_sample / 2**20, fixed / 2**20, fits,
             100 * margin, total / 2**20)
    return fits
