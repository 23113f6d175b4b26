"""The AMP trainer: one training loop with accumulation, clipping, a non-finite guard, early
stopping, per-epoch checkpoints and resume, and recovery from running out of memory (smaller
micro-batches, same effective batch). Knows nothing of Optuna: tuners pass `on_epoch`."""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from modules import distributed, hostmem, interrupts
# Re-exported: callers load checkpoints through the trainer.
from modules.checkpoints import (CheckpointSaver, Progress, load_checkpoint,  # noqa: F401
                                 rank_seed, set_seed)
from modules.config import TrainConfig, UserError, first_line
# Re-exported: callers have long imported these from here.
from modules.device import (REGIONS, apply_process_settings, autocast_dtype,  # noqa: F401
                            region, resolve_device, settings_kept_by_caller)
from modules.evaluation import evaluate
from modules.files import atomic_write_text, compile_failure
from modules.loaders import make_loaders
from modules.models import build_model, num_classes_of
from modules.oom import is_out_of_memory, more_pieces, release

log = logging.getLogger(__name__)

# Steps left out of the timing figures: the first ones pay for CUDA context, cuDNN autotuning,
# allocator growth and lazy imports, seconds on a GPU (docs/speed.md).
TIMING_WARMUP_STEPS = 3
METRIC_BATCHES = 16  # training batches whose correct predictions are counted together

EpochHook = Callable[[int, dict[str, float]], None]


class DivergedError(UserError):
    """The loss stayed NaN/inf for too many steps in a row."""


def trial_failure(exc: BaseException) -> str | None:
    """Why a tuner's short run failed in a way that rules out only its setting: "diverged", or
    "out of memory" (one image did not fit, the trainer having split its batches already).
    None for any other error, and for out of memory under torchrun, where the other ranks may
    be waiting inside the run's collectives: those stop the job."""
    if isinstance(exc, DivergedError):
        return "diverged"
    if is_out_of_memory(exc) and distributed.world_size() == 1:
        return "out of memory"
    return None


@dataclass
class TrainResult:
    model: nn.Module                    # with the best validation epoch's weights
    history: list[dict[str, float]]     # one row per epoch
    best_epoch: int                     # 1-based; 0 when no epoch finished
    best_val_acc: float
    epochs_run: int
    nonfinite_steps: int                # loader batches with a NaN/inf loss (update skipped)
    stopped_early: bool
    resumed_from_epoch: int | None      # completed epochs found in the checkpoint
    wall_s: float                       # seconds of training, the epochs before a resume included
    time_to_best_s: float               # training time until the best epoch ended, seconds
    timing: dict[str, float] = field(default_factory=dict)  # step-time breakdown, resumes included
    settings: dict[str, Any] = field(default_factory=dict)   # resolved device, dtype, ...


def make_optimizer(model: nn.Module, config: TrainConfig, device: torch.device
                   ) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adam":
        cls, options = torch.optim.Adam, {"weight_decay": config.weight_decay}
    elif config.optimizer == "adamw":
        cls, options = torch.optim.AdamW, {"weight_decay": config.weight_decay}
    else:
        cls, options = torch.optim.SGD, {"momentum": config.momentum,
                                         "weight_decay": config.weight_decay,
                                         "nesterov": config.momentum > 0}
    options["lr"] = config.lr
    # How the update runs: fused (one kernel for every parameter), foreach (one multi-tensor
    # op per step of the update) or forloop (one op per parameter). "auto" fuses on CUDA and
    # leaves PyTorch's default elsewhere.
    impl = config.optimizer_impl
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else None
    elif impl == "fused":
        _check_fused(cls, options, params, config)
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "forloop": {"foreach": False}, None: {}}[impl]
    return cls(params, **options, **kernel)


def _check_fused(cls, options: dict[str, Any], params: list[torch.Tensor],
                 config: TrainConfig) -> None:
    """PyTorch checks fused support lazily, at the first step: take one step on a one-element
    stand-in per parameter device and dtype, so an unsupported device, dtype or torch version
    is one clear line before training starts."""
    for device, dtype in {(p.device, p.dtype) for p in params}:
        probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            cls([probe], **options, fused=True).step()
        except (RuntimeError, TypeError, ValueError) as exc:
            reason = first_line(exc, limit=1000)
            raise UserError(f"optimizer_impl fused is not supported for {config.optimizer} with "
                            f"{str(dtype).replace('torch.', '')} parameters on {device.type} "
                            f"in torch {torch.__version__} ({reason}); use auto, foreach or "
                            "forloop.") from None


ONECYCLE_MIN_STEPS = 4  # its ramp up and down each need a step or two


def scheduler_run(config: TrainConfig, steps_per_epoch: int) -> str:
    """The schedule make_scheduler runs: onecycle over fewer than ONECYCLE_MIN_STEPS steps
    would train one or two at its starting rate, lr / 25, and the last at lr / 250,000 (the
    run would barely move): cosine instead, which takes the first at lr."""
    if config.scheduler == "onecycle" and \
            max(1, steps_per_epoch * config.epochs) < ONECYCLE_MIN_STEPS:
        return "cosine"
    return config.scheduler


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, steps_per_epoch: int):
    """A per-optimizer-step schedule over the whole run. With warmup_epochs, cosine and constant
    first ramp the learning rate up linearly: a run that continues trained weights with a fresh
    optimizer otherwise takes its first steps at the peak rate, before Adam's moments have
    settled, and undoes much of what those weights had learned."""
    total_steps = max(1, steps_per_epoch * config.epochs)
    # at most half the run, so that a short one still anneals
    warmup = min(total_steps // 2, round(config.warmup_epochs * steps_per_epoch))
    if warmup > 0 and config.scheduler != "onecycle":
        cosine = config.scheduler == "cosine"

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if not cosine:
                return 1.0
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total_steps - warmup)))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    if config.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if scheduler_run(config, steps_per_epoch) != config.scheduler:
        log.info("onecycle needs at least %d optimizer steps, this run has %d: cosine instead",
                 ONECYCLE_MIN_STEPS, total_steps)
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if config.scheduler == "onecycle":
        # OneCycleLR would cycle SGD's momentum between 0.85 and 0.95 whatever --momentum
        # says; Adam's beta1, which no option sets, keeps the usual cycle.
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr,
                                                   total_steps=total_steps,
                                                   cycle_momentum=config.optimizer != "sgd")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


# ----------------------------------------------------------------------------- training

def train(model: nn.Module, train_loader, val_loader, config: TrainConfig, *,
          run_dir: str | os.PathLike | None = None,
          checkpoint_path: str | os.PathLike | None = None, resume: bool = False,
          on_epoch: EpochHook | None = None, profiler=None) -> TrainResult:
    """Train `model` in place; return it with the weights of its best validation epoch.

    The process-wide settings of `config` (threads, CPU allocator, cuDNN) are the caller's to
    apply (device.apply_process_settings; fit() does).
    run_dir: TensorBoard scalars and the run's config.json go here.
    checkpoint_path: state after every epoch; with resume=True training continues from it.
    on_epoch(epoch, metrics): called after every epoch (1-based); may raise to stop (pruning).
    profiler: anything with step() (modules.profiler.TorchProfiler), stepped once per batch.
    """
    started = time.perf_counter()
    device = resolve_device(config.device)
    dtype = autocast_dtype(config.amp, device)
    model.to(device, memory_format=_memory_format(config))
    num_classes = num_classes_of(model)
    if len(train_loader) == 0:
        raise UserError("the training split is empty; add images or lower --batch-size.")
    # every epoch is judged on it (under torchrun a rank's share may be empty: the others')
    if val_loader is None or (len(val_loader) == 0 and distributed.world_size() == 1):
        raise UserError("the validation split is empty: each epoch is judged on it; give it "
                        "images (a val/ folder, or more images per class).")
    optimizer = make_optimizer(model, config, device)
    # a model trained before (a run that diverged, or was stopped mid-window, in a notebook)
    # keeps its last gradients: the first window would add them to its own
    optimizer.zero_grad(set_to_none=True)
    steps_per_epoch = math.ceil(len(train_loader) / config.grad_accum_steps)
    scheduler = make_scheduler(optimizer, config, steps_per_epoch)
    # GradScaler only matters for fp16, whose narrow range underflows small gradients.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    saver = CheckpointSaver(checkpoint_path, config, len(train_loader))
    progress = (saver.restore(model, optimizer, scheduler, scaler) if resume else None) or Progress()
    # Under torchrun every rank trains the same model on its own shard of each batch; the
    # gradients are averaged once per optimizer step (distributed.average_gradients).
    distributed.broadcast_state(model)
    timer = StepTimer(device, len(train_loader) * max(0, config.epochs - progress.start_epoch),
                      carried=progress.timing if progress.resumed_from is not None else None)
    epochs = _Epochs(model, optimizer, scheduler, scaler, config, device, dtype, progress, timer,
                     profiler)
    elapsed_before, stopped_early, profiled_before = progress.elapsed_s, False, 0.0
    said_by_thread, writer = threading.excepthook, None
    threading.excepthook = _writer_errors_said_once(said_by_thread)
    try:  # the event file is closed however the loop ends (pruned, diverged, Ctrl-C)
        # a finished run resumed trains nothing: it opens no event file (each --resume left
        # an empty one) and purges nothing (its folder may hold the scalars of another
        # scenario's final run that it took, with more epochs)
        if progress.start_epoch < config.epochs:
            writer = _summary_writer(run_dir if distributed.is_main() else None, config,
                                     first_step=progress.start_epoch + 1)
        for epoch in range(progress.start_epoch, config.epochs):
            epoch_start = time.perf_counter()
            row = epochs.train_one(train_loader, epoch)
            val = evaluate(model, val_loader, device=device, amp_dtype=dtype,
                           channels_last=config.channels_last, num_classes=num_classes,
                           pieces=epochs.eval_pieces,
                           progress=f"validation {epoch + 1}/{config.epochs}"
                           if epochs.bars else None)
            epochs.eval_pieces = val["pieces"]
            if not math.isfinite(val["loss"]):
                # An update from a finite loss can leave weights that give NaN/inf everywhere
                # after it; with fewer batches an epoch than max_nonfinite_steps the in-epoch
                # guard never fires, and the broken model would be kept as the best so far.
                what = ("its weights were NaN/inf" if not _finite_weights(model) else
                        "every training batch's loss was NaN/inf"
                        if not math.isfinite(row["train_loss"]) else None)
                if what is not None:
                    raise DivergedError(
                        f"training diverged: after epoch {epoch + 1} {what}, and the validation "
                        f"loss too (lr={config.lr:g}); {_lower_lr(config)}.")
            profiled_s = epochs.profiler_s  # the profiler's own seconds are not the run's
            row.update(val_loss=val["loss"], val_acc=val["acc"], lr=row.pop("lr"),
                       epoch_s=time.perf_counter() - epoch_start - (profiled_s - profiled_before),
                       samples_per_s=row.pop("samples_per_s"))
            profiled_before = profiled_s
            row["elapsed_s"] = elapsed_before + (time.perf_counter() - started) - profiled_s
            _log_epoch(row, config.epochs, writer)
            # patience running out at the last epoch stops nothing: the run trained them all
            stopped_early = progress.record(row, model, config.early_stopping_patience) and \
                epoch + 1 < config.epochs
            finished = stopped_early or epoch + 1 == config.epochs
            if finished and epochs.windows and not epochs.applied and \
                    progress.resumed_from is None:
                # fewer windows than max_nonfinite_steps, every one skipped: nothing trained
                # (a resumed session's earlier ones may have)
                raise DivergedError(
                    f"training diverged: the loss was NaN/inf in every optimizer step of this "
                    f"run ({progress.consecutive_bad} batches), so no update was applied "
                    f"(lr={config.lr:g}); check the data, or lower --lr.")
            saver.save(progress, finished, model, optimizer, scheduler, scaler, timer.state())
            if on_epoch is not None:
                on_epoch(row["epoch"], row)
            if stopped_early:
                log.info("early stopping: no better val accuracy for %d epochs; best was epoch %d "
                         "(%.1f%%)", config.early_stopping_patience, progress.best["epoch"],
                         100 * progress.best["acc"])
                break
    finally:
        try:
            if writer is not None:
                writer.close()
        finally:
            threading.excepthook = said_by_thread
    if progress.best["state"] is not None:
        model.load_state_dict(progress.best["state"])
    history, best = progress.history, progress.best
    best_row = next((r for r in history if r["epoch"] == best["epoch"]), None)
    return TrainResult(
        model=model, history=history, best_epoch=best["epoch"], best_val_acc=max(best["acc"], 0.0),
        epochs_run=len(history), nonfinite_steps=progress.nonfinite_steps,
        stopped_early=stopped_early or (bool(history) and len(history) < config.epochs),
        resumed_from_epoch=progress.resumed_from,
        wall_s=elapsed_before + time.perf_counter() - started - epochs.profiler_s,
        time_to_best_s=best_row["elapsed_s"] if best_row else 0.0, timing=timer.summary(),
        settings={"device": str(device), "amp_dtype": str(dtype).replace("torch.", "") if dtype
                  else "fp32", "effective_batch_size": config.effective_batch_size,
                  # per optimizer step over all of torchrun's processes (--batch-size is each
                  # process's)
                  "global_batch_size": config.effective_batch_size * distributed.world_size(),
                  "micro_batch_size": math.ceil(config.batch_size / epochs.splits),
                  "oom_recoveries": epochs.oom_recoveries,
                  "compile_failed": epochs.compile_failed,
                  "steps_per_epoch": steps_per_epoch,
                  # a onecycle too short for its cycle ran cosine (settings' scheduler is
                  # the one asked for, which a later run's baseline is matched by)
                  "scheduler_run": scheduler_run(config, steps_per_epoch),
                  "world_size": distributed.world_size(), "cpu_threads": torch.get_num_threads(),
                  "cpu_allocator": hostmem.current(), "torch": torch.__version__})


def _lower_lr(config: TrainConfig) -> str:
    """What a diverged run can change: the rate, and clipping where it is off."""
    return "lower --lr" + ("" if config.max_grad_norm else " or set --max-grad-norm 1.0")


def _finite_weights(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _compile_failed(exc: BaseException) -> bool:
    """torch.compile's backend could not build the graph (loaded only once compile ran)."""
    dynamo = sys.modules.get("torch._dynamo.exc")
    failed = getattr(dynamo, "BackendCompilerFailed", None)
    return failed is not None and isinstance(exc, failed)


class _Epochs:
    """The training epochs of one run: every loader batch's forward and backward (replayed in
    smaller pieces after running out of memory), and one optimizer step per window of
    grad_accum_steps batches, skipped when a loss in it was NaN/inf. Holds what lasts from
    epoch to epoch: the pieces a batch is cut into, and the count of non-finite batches."""

    def __init__(self, model: nn.Module, optimizer, scheduler, scaler, config: TrainConfig,
                 device: torch.device, dtype: torch.dtype | None, progress: Progress,
                 timer: StepTimer, profiler=None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.config, self.device, self.dtype = config, device, dtype
        self.progress, self.timer, self.profiler = progress, timer, profiler
        # progress bars, drawn by one process under torchrun, as the logs are
        self.bars = config.progress and distributed.is_main()
        # Seconds the profiler took between steps (writing its trace): not training time.
        self.profiler_s = 0.0
        self.forward = torch.compile(model) if config.compile else model
        self.compile_failed: str | None = None  # why, when --compile fell back to eager
        self.memory_format = _memory_format(config)
        # After running out of memory every loader batch goes through in `splits` chunks (x2 per
        # recovery); the optimizer step still sees the same samples, so the effective batch stays.
        self.splits, self.oom_recoveries = 1, 0
        self.eval_pieces = 1  # the same for the validation batches, which find it on their own
        self.windows = self.applied = 0  # optimizer steps due, and taken, in this session
        # BatchNorm's running statistics are updated in the forward pass, before the loss is
        # checked: a window skipped for a NaN/inf puts them back as the window found them
        # (else they stay NaN, and so does every later evaluation).
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.batch_norm = bool(norms)
        self.norm_buffers = [b for m in norms for b in m.buffers()]
        self.norm_saved = [b.detach().clone() for b in self.norm_buffers]

    def train_one(self, loader, epoch: int) -> dict[str, float]:
        """One epoch over `loader` (0-based `epoch`); returns its training row."""
        started = time.perf_counter()
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        self.model.train()
        metrics = _EpochMetrics(self.device)
        self.last_lr = self.optimizer.param_groups[0]["lr"]  # of the epoch's last step
        accum, n_batches = self.config.grad_accum_steps, len(loader)
        bar = tqdm(total=n_batches, desc=f"epoch {epoch + 1}/{self.config.epochs}", leave=False,
                   disable=not self.bars, dynamic_ncols=True)
        batches = iter(loader)
        window_batches: list[tuple[torch.Tensor, torch.Tensor]] = []  # replayed after an OOM
        pending: list[tuple[Any, list]] = []  # (finite flag, metrics) per window batch
        profiler_before = self.profiler_s
        for i in range(n_batches):
            interrupts.check()
            # A profiled step is slower than others: the step timing leaves it out.
            profiled = getattr(self.profiler, "recording", False)
            self.timer.begin()
            with region("data_wait"):
                x, y = next(batches)
            self.timer.loaded()
            with region("h2d"):
                x = x.to(self.device, non_blocking=True, memory_format=self.memory_format)
                y = y.to(self.device, non_blocking=True)
            self.timer.copied()
            window_start = i - i % accum
            window = min(accum, n_batches - window_start)  # loader batches in this optimizer step
            if i == window_start:
                window_batches.clear()
                pending.clear()
                if self.norm_buffers:
                    torch._foreach_copy_(self.norm_saved, self.norm_buffers)
            window_batches.append((x, y))
            first, done = self._forward_backward(window_batches, window)
            pending[first:] = done  # a replayed window replaces its earlier entries
            if i - window_start + 1 == window:
                self._step(pending, metrics, epoch)
            self.timer.end(y.shape[0], counted=not profiled)
            if self.profiler is not None:
                mark = time.perf_counter()
                self.profiler.step()
                self.profiler_s += time.perf_counter() - mark
            bar.update(1)
        bar.close()
        train_s = time.perf_counter() - started - (self.profiler_s - profiler_before)
        self.timer.epoch_end()
        loss, acc, seen = metrics.totals()
        return {"epoch": epoch + 1, "train_loss": loss, "train_acc": acc, "samples": seen,
                "lr": self.last_lr, "samples_per_s": seen / train_s if train_s > 0 else 0.0}

    def _forward_backward(self, window_batches: list[tuple[torch.Tensor, torch.Tensor]],
                          window: int) -> tuple[int, list[tuple[Any, list]]]:
        """Forward and backward the window's newest batch; after running out of memory, the
        whole window again in twice as many pieces. Returns (index of the first batch done,
        their (finite, parts))."""
        first = len(window_batches) - 1
        while True:
            try:
                nominal = window_batches[0][1].shape[0]  # a short batch is the epoch's last
                return first, [forward_backward(self.forward, bx, by, self.splits, window,
                                                self.device, self.dtype, self.scaler, nominal)
                               for bx, by in window_batches[first:]]
            except RuntimeError as exc:  # torch's OutOfMemoryError is a RuntimeError
                if self.forward is not self.model and _compile_failed(exc):
                    # --compile where it cannot build (no C++ compiler, say): eager, as asked
                    # for speed, rather than no run at all. Nothing of the pass was applied.
                    self.compile_failed = compile_failure(first_line(exc))
                    log.warning("torch.compile failed here (%s): training without it",
                                self.compile_failed)
                    self.forward = self.model
                    self._restart_window()
                    first = 0
                    continue
                # Under torchrun too: nothing here is a collective, so this rank alone replays
                # its window in smaller pieces while the others wait at the step.
                if not is_out_of_memory(exc):
                    raise
            # Recover outside the except block: its traceback holds the failed pass's frames
            # and with them its activations; by now they are released.
            self._restart_window()
            release(self.device)
            self.splits = _more_splits(self.splits, window_batches[-1][1], self.config,
                                       self.batch_norm)
            self.oom_recoveries += 1
            first = 0  # the whole window again, from its first batch

    def _restart_window(self) -> None:
        """Undo what a failed pass of the window left: its partial gradient, and the BatchNorm
        statistics its forwards updated (the replay updates them again)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.norm_buffers:
            torch._foreach_copy_(self.norm_buffers, self.norm_saved)

    def _step(self, pending: list[tuple[Any, list]], metrics: _EpochMetrics, epoch: int) -> None:
        """The window's end: count its batches' metrics and take the optimizer step, or skip it
        when a loss was NaN/inf (stopping when that keeps happening)."""
        # The finite check reads the losses once per optimizer step, after the backward is
        # queued: on a GPU the host waits for the forward while the device is still busy,
        # instead of idling the device with a sync between forward and backward.
        # Under torchrun a global batch is bad when any rank's share of it is: every rank counts
        # those, so all stop together when training diverges, after as many as one process
        # would.
        bad = sum(distributed.any_rank([not bool(flag) for flag, _ in pending], self.device))
        step_ok = bad == 0
        for flag, parts in pending:  # commit each batch's metrics exactly once
            if flag:
                metrics.add(parts)
        progress = self.progress
        # A finite batch in a window skipped for another's NaN applied no update either: only
        # an applied window ends the run of bad batches (with accumulation, a NaN in every
        # window would otherwise train nothing and never stop).
        progress.consecutive_bad = 0 if step_ok else progress.consecutive_bad + bad
        progress.nonfinite_steps += bad
        if not step_ok and self.norm_buffers:
            # before the run may stop here: a model kept (a notebook's retry) must not carry
            # the NaN window's BatchNorm statistics, which no later update can wash out
            torch._foreach_copy_(self.norm_buffers, self.norm_saved)
        if progress.consecutive_bad >= self.config.max_nonfinite_steps:
            raise DivergedError(
                f"training diverged: the loss was NaN/inf in {progress.consecutive_bad} "
                f"batches with no update applied between them, up to epoch {epoch + 1} "
                f"(lr={self.config.lr:g}); {_lower_lr(self.config)}.")
        self.windows += 1
        with region("optimizer_step"):
            if step_ok:  # a NaN/inf anywhere in the window skips its whole update
                self.last_lr = self.optimizer.param_groups[0]["lr"]
                window_scale(self.model, pending)
                distributed.average_gradients(self.model)
                optimizer_step(self.model, self.optimizer, self.scaler, self.config.max_grad_norm)
                distributed.broadcast_state(self.model, buffers_only=True)
                self.applied += 1
            # A skipped window still uses up its step of the schedule (as fp16's GradScaler
            # skips do), so cosine and one-cycle end at the run's last window.
            with warnings.catch_warnings():  # a first window skipped: no optimizer.step() yet
                warnings.filterwarnings("ignore", "Detected call of", UserWarning)
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)


class _EpochMetrics:
    """An epoch's training loss and accuracy, summed on the device (no host sync per step) and
    over every process under torchrun."""

    def __init__(self, device: torch.device):
        self.device = device
        self.correct = _CorrectCount(device)
        self.loss_sum = torch.zeros((), device=device)
        self.seen = 0

    def add(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for logits, y, loss in parts:
            self.loss_sum.add_(loss, alpha=y.shape[0])  # one kernel
            self.seen += y.shape[0]
            self.correct.add(logits, y)

    def totals(self) -> tuple[float, float, int]:
        """(mean loss, accuracy, samples); NaN for both when no sample counted."""
        loss_sum, seen, n_correct = self.loss_sum, self.seen, self.correct.total()
        if distributed.world_size() > 1:
            totals = distributed.all_reduce_sum(torch.stack([loss_sum.float(), torch.tensor(
                float(seen), device=self.device), n_correct.float()]))
            loss_sum, seen, n_correct = totals[0], int(totals[1].item()), totals[2].round().long()
        if not seen:
            return float("nan"), float("nan"), 0
        return (loss_sum / seen).item(), n_correct.item() / seen, seen


class StepTimer:
    """Where the training steps' time goes: waiting for data, the copy to the device, the
    whole step, host CPU time and, on a GPU, the device's own time (CUDA events, summed once
    per epoch so steps keep overlapping). The first TIMING_WARMUP_STEPS steps are left out
    (when the run has enough of them). `carried`: the figures of the epochs a resumed run
    trained before, added in when they were timed on the same device and process count."""

    def __init__(self, device: torch.device, planned_steps: int,
                 carried: dict[str, Any] | None = None):
        self.device, self.world = device, distributed.world_size()
        self.totals: dict[str, float] = {"data_wait_s": 0.0, "h2d_s": 0.0, "step_s": 0.0,
                                         "cpu_s": 0.0, "steps": 0, "samples": 0}
        if device.type == "cuda":
            self.totals["gpu_compute_s"] = 0.0
        if carried and (carried.get("device"), carried.get("world")) == (device.type, self.world):
            self.totals.update({k: v for k, v in carried.items() if k in self.totals})
        elif carried:
            log.info("the epochs before were timed on %s x%s; the step timing covers this "
                     "process's epochs only", carried.get("device"), carried.get("world"))
        self.warmup = TIMING_WARMUP_STEPS if planned_steps > 2 * TIMING_WARMUP_STEPS else 0
        # The warm-up steps' own totals: the figures when a run ends within them (early stopping)
        self.warm_totals = {k: 0.0 if isinstance(v, float) else 0 for k, v in self.totals.items()
                            if k != "gpu_compute_s"}  # no GPU events recorded for them
        self.step_no = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def loaded(self) -> None:
        self._t1 = time.perf_counter()

    def copied(self) -> None:
        self._t2 = time.perf_counter()
        if self.device.type == "cuda":
            self._gpu_start = torch.cuda.Event(enable_timing=True)
            self._gpu_start.record()

    def end(self, samples: int, counted: bool = True) -> None:
        """counted=False: a step unlike the others (profiled), timed as a warm-up step is."""
        t3 = time.perf_counter()
        timed = self.step_no >= self.warmup and counted
        if timed and self.device.type == "cuda":
            gpu_end = torch.cuda.Event(enable_timing=True)
            gpu_end.record()
            self._events.append((self._gpu_start, gpu_end))
        t = self.totals if timed else self.warm_totals
        t["data_wait_s"] += self._t1 - self._t0
        t["h2d_s"] += self._t2 - self._t1
        t["step_s"] += t3 - self._t0
        t["cpu_s"] += time.process_time() - self._c0  # host CPU, all threads
        t["steps"] += 1
        t["samples"] += samples
        self.step_no += 1

    def epoch_end(self) -> None:
        if self._events:
            torch.cuda.synchronize(self.device)  # once per epoch, so steps keep overlapping
            self.totals["gpu_compute_s"] += sum(a.elapsed_time(b) for a, b in self._events) / 1000
            self._events.clear()

    def state(self) -> dict[str, Any]:
        """The totals, as a checkpoint keeps them."""
        return {**self.totals, "device": self.device.type, "world": self.world}

    def summary(self) -> dict[str, Any]:
        """The totals and the figures derived from them (TrainResult.timing); the warm-up
        steps' when the run ended within them, and None, not 0, when no step ran."""
        t, warmup = dict(self.totals), self.warmup
        if not t["steps"] and self.warm_totals["steps"]:
            t, warmup = dict(self.warm_totals), 0  # no GPU events: those were not recorded
        steps, step_s = t["steps"], t["step_s"]
        if not steps or step_s <= 0:
            t.update(avg_step_ms=None, data_wait_frac=None, h2d_frac=None, gpu_compute_frac=None,
                     samples_per_s=None, cpu_exec_us=None, warmup_steps=warmup)
            return t
        t.update(avg_step_ms=1000 * step_s / steps,
                 data_wait_frac=t["data_wait_s"] / step_s,
                 h2d_frac=t["h2d_s"] / step_s,
                 gpu_compute_frac=t["gpu_compute_s"] / step_s if "gpu_compute_s" in t else None,
                 samples_per_s=self.world * t["samples"] / step_s,  # equal shards per rank
                 cpu_exec_us=1e6 * t["cpu_s"] / steps, warmup_steps=warmup)
        return t


def _memory_format(config: TrainConfig) -> torch.memory_format:
    return torch.channels_last if config.channels_last else torch.contiguous_format


def _log_epoch(row: dict[str, float], epochs: int, writer) -> None:
    log.info("epoch %d/%d  train loss %.4f acc %.1f%%  val loss %.4f acc %.1f%%  %.1f s, "
             "%.0f img/s", row["epoch"], epochs, row["train_loss"], 100 * row["train_acc"],
             row["val_loss"], 100 * row["val_acc"], row["epoch_s"], row["samples_per_s"])
    if writer is not None:
        for key in ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "samples_per_s"):
            writer.add_scalar(key.replace("_", "/", 1), row[key], row["epoch"])
        writer.flush()


def train_step(forward, model: nn.Module, optimizer: torch.optim.Optimizer, scaler,
               x: torch.Tensor, y: torch.Tensor, *, device: torch.device,
               dtype: torch.dtype | None, max_grad_norm: float | None = None) -> bool:
    """One optimizer step on one batch, built from the same two pieces train() uses
    (forward_backward, optimizer_step): what the autotuner times and the memory probe
    measures is the step that trains. Returns whether the loss was finite (if not, no update)."""
    optimizer.zero_grad(set_to_none=True)
    finite, _ = forward_backward(forward, x, y, 1, 1, device, dtype, scaler)
    ok = bool(finite)  # on a GPU: waits for the loss flag's copy, once
    if ok:
        optimizer_step(model, optimizer, scaler, max_grad_norm)
    return ok


def window_scale(model: nn.Module, pending: list[tuple[Any, list]]) -> None:
    """A window with a short batch (a loader that keeps the epoch's last, smaller one; the
    pipeline's drop it) summed its gradients over window x nominal samples it did not all
    have: scaled to the mean over those it had, as one large batch of them gives."""
    sizes = [y.shape[0] for _, parts in pending for _, y, _ in parts]
    nominal = sum(y.shape[0] for _, y, _ in pending[0][1]) if pending else 0
    if not sizes or sum(sizes) == nominal * len(pending):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, nominal * len(pending) / sum(sizes))


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler,
                   max_grad_norm: float | None) -> None:
    """Apply the accumulated gradients: clipped to max_grad_norm (unscaled first, so the true
    gradients are clipped, not fp16-scaled ones), then the step and the loss scale's update."""
    if max_grad_norm is not None:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()


def forward_backward(forward, x: torch.Tensor, y: torch.Tensor, splits: int, window: int,
                     device: torch.device, dtype: torch.dtype | None, scaler,
                     nominal: int | None = None
                     ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Forward and backward one loader batch, in `splits` chunks (1 until memory ran out).

    Each chunk's loss is weighted by its share of a `nominal` batch (default: this one) and
    divided by the batches in the optimizer window, so the window's summed gradient is a sum
    over its samples / (window x nominal): a mean over them however they are cut, once the
    step has rescaled a window with a short batch (window_scale). Nothing here waits for the
    device. Returns (finite, parts): bool(finite) is False
    when any chunk's loss was NaN/inf (the caller then skips the window's update);
    parts holds (logits, y, loss), detached, per chunk, for the epoch's metrics.
    """
    n = y.shape[0]
    nominal = nominal or n
    size = math.ceil(n / splits)
    chunks = [(x, y)] if size >= n else list(zip(x.split(size), y.split(size)))
    if len(chunks) > 1 and chunks[-1][1].shape[0] == 1 < size:
        # a lone last sample (10 in pieces of 3: 3, 3, 3, 1) breaks BatchNorm in train mode
        # where its maps are 1x1, as training's short last batch would (drops_last): it joins
        # the chunk before it
        (ax, ay), (bx, by) = chunks[-2], chunks.pop()
        chunks[-1] = (torch.cat([ax, bx]), torch.cat([ay, by]))
    finite, parts = None, []
    for k, (cx, cy) in enumerate(chunks):
        with region("forward"), \
                torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = forward(cx)
            loss = F.cross_entropy(logits, cy)
        # 0 * loss is 0 for a finite loss and NaN for NaN or +-inf: torch.isfinite's result in
        # two kernels instead of four (a launch-bound GPU step feels each one)
        ok = (loss.detach() * 0).eq(0)
        finite = ok if finite is None else finite & ok
        if k == len(chunks) - 1 and device.type == "cuda":
            # Copy the flag to the host now, before the backward is queued behind it: reading
            # it then waits for this forward only, not for the whole step.
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(finite, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            finite = _Flag(host, ready)
        with region("backward"):
            # A whole batch keeps the plain loss / window (bit for bit as before chunking).
            share = loss if cy.shape[0] == nominal else loss * (cy.shape[0] / nominal)
            # (no division by a window of 1: one kernel less each way, on a launch-bound GPU)
            scaler.scale(share / window if window > 1 else share).backward()
        parts.append((logits.detach(), cy, loss.detach()))
    return finite, parts


class _CorrectCount:
    """An epoch's correct training predictions, counted on the device METRIC_BATCHES batches
    at a time, with no host sync (torchmetrics' update validates its inputs every call).

    Counting every batch as it came (argmax, eq, sum, add) is four kernel launches a step,
    which a launch-bound GPU step feels, and a CPU step does not (docs/speed.md). The batches'
    logits are held meanwhile (batch x classes each, detached)."""

    def __init__(self, device: torch.device):
        self._count = torch.zeros((), device=device, dtype=torch.int64)
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        self._held.append((logits, y))
        if len(self._held) >= METRIC_BATCHES:
            self._count_held()

    def _count_held(self) -> None:
        if self._held:
            logits = torch.cat([logits for logits, _ in self._held])
            y = torch.cat([y for _, y in self._held])
            self._count += (logits.argmax(1) == y).sum()
            self._held.clear()

    def total(self) -> torch.Tensor:
        """The count so far, as a 0-dim int64 tensor on the device."""
        self._count_held()
        return self._count


class _Flag:
    """A GPU bool on its way to the host: bool() waits for the copy, not for later work."""

    def __init__(self, host: torch.Tensor, ready: torch.cuda.Event):
        self.host, self.ready = host, ready

    def __bool__(self) -> bool:
        self.ready.synchronize()
        return bool(self.host)


def _more_splits(splits: int, failed_y: torch.Tensor, config: TrainConfig,
                 batch_norm: bool) -> int:
    """Twice the chunks per loader batch after running out of memory, or OutOfMemoryError when
    the chunk that failed already held a single sample. batch_norm: the model has BatchNorm,
    whose batch statistics then come from each chunk, not the whole batch."""
    before = math.ceil(config.batch_size / splits)
    splits = more_pieces(splits, failed_y.shape[0], (
        f"out of memory even with one {config.image_size} px image per forward/backward "
        f"pass ({config.model}); lower --image-size or use a smaller --model."))
    micro = math.ceil(config.batch_size / splits)
    norm = (f"; its BatchNorm statistics are now computed per micro-batch of {micro} images"
            if batch_norm else "")
    log.warning("out of memory at micro-batch %d (%d px); continuing with micro-batch %d and %dx "
                "more accumulation: the effective batch stays %d%s", before, config.image_size,
                micro, splits, config.effective_batch_size, norm)
    return splits


def _writer_errors_said_once(hook):
    """threading.excepthook, less the traceback of TensorBoard's writer thread: its error (a
    full disk) is raised again in the training loop's next write, which ends the run with one
    line; printed from the thread as well, it came first, as a traceback."""
    def said_once(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and \
                isinstance(args.exc_value, OSError):
            return
        hook(args)
    return said_once


def _summary_writer(run_dir, config: TrainConfig, first_step: int = 1):
    """TensorBoard's writer for run_dir; what an earlier session logged from first_step (the
    epoch this one starts at) on is dropped: it logged an epoch whose checkpoint it did not
    live to write, which this session trains again."""
    if run_dir is None:
        return None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config.to_json(), run_dir / "config.json")
    from torch.utils.tensorboard import (
        SummaryWriter,  # imported late: it loads TensorBoard
    )
    # Each epoch flushes its own scalars; flush_secs only bounds how long the writer's thread
    # sleeps between looks at its queue. A Ctrl-C that lands inside the writer's queue code
    # can cost that thread the wake-up for close()'s stop signal, and close() then waited out
    # TensorBoard's default 120 s before the run said it was interrupted.
    return SummaryWriter(log_dir=str(run_dir), purge_step=first_step, flush_secs=1)


def prepare(index, config: TrainConfig, test: bool = True) -> tuple[nn.Module, Any, Any, Any]:
    """Seed, then build the model and the (train, val, test) loaders for a DatasetIndex (test
    None unless `test`: make_loaders)."""
    set_seed(config.seed)
    model = build_model(config.model, len(index.classes), config.weights, config.dropout_impl)
    if distributed.rank() > 0:
        # Under torchrun each rank draws its own augmentation, dropout masks and worker seeds,
        # as the decoded cache's do; rank 0 draws as one process. The weights, drawn above
        # alike, are rank 0's anyway (train broadcasts them).
        set_seed(rank_seed(config.seed))
    return (model, *make_loaders(index, config, test=test))


def fit(index, config: TrainConfig, **train_kwargs) -> TrainResult:
    """The process settings, prepare() and train: what a tuner calls for one candidate.
    Keyword arguments go to `train` (run_dir, on_epoch, checkpoint_path, ...). Called outside
    a run, the process settings are the caller's again after."""
    with settings_kept_by_caller():
        apply_process_settings(config, resolve_device(config.device))
        model, train_loader, val_loader, _ = prepare(index, config, test=False)
        return train(model, train_loader, val_loader, config, **train_kwargs)
