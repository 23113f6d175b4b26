"""A training run's checkpoint: what it has done so far (Progress), written after every epoch
and read back by a resume (CheckpointSaver), with every random stream, so a resumed run
continues exactly as the uninterrupted one would. One exception: persistent DataLoader workers
(the streaming path on more than two cores, when the decoded images do not fit in memory) keep
their augmentation streams from epoch to epoch, and a resume starts them afresh, so its
augmentations, not its data order, differ from the uninterrupted run's."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from modules import distributed, membership
from modules.config import DEFAULTS, TrainConfig, UserError, first_line
from modules.files import atomic_torch_save, read_torch_file
from modules.oom import is_out_of_memory

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
# Settings a checkpoint must share with the run that resumes it.
RESUME_KEYS = ("model", "image_size", "batch_size", "grad_accum_steps", "optimizer", "scheduler",
               "warmup_epochs", "epochs", "lr", "seed", "momentum", "weight_decay",
               "max_grad_norm")


@dataclass
class Progress:
    """What a run has done so far: its epochs' rows and its best epoch."""
    history: list[dict[str, float]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=lambda: {"acc": -1.0, "epoch": 0,
                                                          "state": None})
    bad_epochs: int = 0                 # epochs since the best one
    nonfinite_steps: int = 0            # loader batches whose loss was NaN/inf
    # NaN/inf batches since the last applied update, across epochs (a small set's epoch can
    # hold fewer batches than max_nonfinite_steps) and across a resume
    consecutive_bad: int = 0
    start_epoch: int = 0                # the first epoch (0-based) this process trains
    resumed_from: int | None = None     # epochs the checkpoint held, on resume
    timing: dict[str, Any] = field(default_factory=dict)  # the step timing saved with them

    def record(self, row: dict[str, float], model: nn.Module, patience: int | None) -> bool:
        """Add an epoch's row; keep the model's weights when it is the best so far. Returns
        whether to stop early (no better validation accuracy for `patience` epochs)."""
        self.history.append(row)
        if row["val_acc"] > self.best["acc"]:
            self.best = {"acc": row["val_acc"], "epoch": row["epoch"], "state": cpu_state(model)}
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
        return patience is not None and self.bad_epochs >= patience

    @property
    def elapsed_s(self) -> float:
        """Training seconds of the epochs recorded so far (of earlier processes too)."""
        return self.history[-1]["elapsed_s"] if self.history else 0.0


class CheckpointSaver:
    """The checkpoint file of one run (timm's CheckpointSaver is the shape): `restore` on
    resume, `save` after every epoch (rank 0 only, atomically: a kill mid-write leaves the
    previous one intact). A None path saves and restores nothing."""

    def __init__(self, path: str | Path | None, config: TrainConfig,
                 steps_per_epoch: int | None = None):
        self.path, self.config = (Path(path) if path else None), config
        # The learning-rate schedule is laid out in these (a torchrun run resumed in fewer
        # processes has more per epoch, and another effective batch): a resume must match.
        self.layout = {"world_size": distributed.world_size(), "steps_per_epoch": steps_per_epoch}

    def restore(self, model: nn.Module, optimizer, scheduler, scaler) -> Progress | None:
        """Load the checkpoint into the run's objects and the random streams; None when there
        is none. A checkpoint of other settings is refused in one line."""
        if self.path is None:
            return None
        ckpt = self._read()
        if ckpt is None:
            return None
        check_resumable(ckpt, self.config, self.path)
        saved = ckpt.get("layout") or {}  # absent from older checkpoints
        if saved.get("world_size", self.layout["world_size"]) != self.layout["world_size"]:
            raise UserError(f"cannot resume from {str(self.path)!r}: it was written by "
                            f"{saved['world_size']} processes, and this run has "
                            f"{self.layout['world_size']}; resume with as many (torchrun "
                            "--nproc_per_node), or run without --resume to start over.")
        if None not in (saved.get("steps_per_epoch"), self.layout["steps_per_epoch"]) and \
                saved["steps_per_epoch"] != self.layout["steps_per_epoch"]:
            raise UserError(f"cannot resume from {str(self.path)!r}: its epochs had "
                            f"{saved['steps_per_epoch']} steps, this run's have "
                            f"{self.layout['steps_per_epoch']}; run without --resume to start "
                            "over.")
        try:
            return self._restore_from(ckpt, model, optimizer, scheduler, scaler)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
            if is_out_of_memory(exc):  # the optimizer's state moved to a full GPU: not damage
                raise
            # a file torch reads, of this format, whose contents are not what save() wrote
            raise UserError(f"checkpoint {str(self.path)!r} is damaged ({type(exc).__name__}: "
                            f"{first_line(exc)}); delete it to start this scenario over."
                            ) from None

    def _restore_from(self, ckpt: dict[str, Any], model: nn.Module, optimizer, scheduler,
                      scaler) -> Progress:
        model.load_state_dict(ckpt["model"])
        # load_state_dict copies the saved groups' kernel flags over those this run's
        # make_optimizer chose (a GPU's fused kernel resumed on a CPU, a --optimizer-impl
        # changed): this run's go into the saved groups first, as they are a speed setting,
        # not learned state, and torch places each `step` by them (on the GPU for fused).
        saved = ckpt["optimizer"]
        optimizer.load_state_dict({**saved, "param_groups": [
            {**group, **{k: mine[k] for k in OPTIMIZER_KERNEL_KEYS if k in mine}}
            for group, mine in zip(saved["param_groups"], optimizer.param_groups)]})
        scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt["scaler"]:  # empty from a run without fp16 (a CPU, bf16): a fresh scale here
            scaler.load_state_dict(ckpt["scaler"])
        set_rng_state(ckpt["rng"])
        if distributed.rank() > 0:
            # rank 0's streams were saved: the others continue on streams of their own
            # (distinct, though not the ones they would have drawn uninterrupted)
            set_seed(rank_seed(self.config.seed, ckpt["epoch"]))
        log.info("resuming from %s after epoch %d", self.path, ckpt["epoch"])
        # Early stopping's patience is this run's to set: a run that had stopped early trains
        # on under a longer one (or none), and one that has already waited this run's stops.
        patience = self.config.early_stopping_patience
        waited = patience is not None and ckpt["bad_epochs"] >= patience
        finished = ckpt["epoch"] >= self.config.epochs or waited
        if ckpt["finished"] != finished and ckpt["epoch"] < self.config.epochs:
            log.info("early stopping: %d epochs without a better val accuracy, and patience %s: "
                     "%s", ckpt["bad_epochs"], patience if patience is not None else "none",
                     "stopping here" if finished else
                     f"training on from epoch {ckpt['epoch'] + 1}")
        return Progress(history=ckpt["history"], best=ckpt["best"], bad_epochs=ckpt["bad_epochs"],
                        nonfinite_steps=ckpt["nonfinite_steps"],
                        consecutive_bad=ckpt.get("consecutive_bad", 0),  # older checkpoints
                        # finished: nothing left to train; the caller restores the best epoch
                        start_epoch=self.config.epochs if finished else ckpt["epoch"],
                        resumed_from=ckpt["epoch"],
                        timing=ckpt.get("timing", {}))  # absent from older checkpoints

    def _read(self) -> dict[str, Any] | None:
        """The checkpoint, None when there is none. Under torchrun rank 0's, on every rank:
        only rank 0 writes checkpoints, so on another machine there is none (or an older
        copy), and a rank that started afresh while rank 0 resumed would train with its own
        optimizer state until the ranks' collectives fell out of step."""
        return distributed.main_computes(
            lambda: load_checkpoint(self.path) if self.path.exists() else None)

    def save(self, progress: Progress, finished: bool, model: nn.Module, optimizer, scheduler,
             scaler, timing: dict[str, Any]) -> None:
        if self.path is None or not distributed.is_main():
            return
        save_checkpoint(self.path, {
            "format": CHECKPOINT_FORMAT, "epoch": progress.history[-1]["epoch"],
            "finished": finished, "config": self.config.to_dict(), "model": cpu_state(model),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rng_state(), "history": progress.history,
            "best": progress.best, "bad_epochs": progress.bad_epochs,
            "nonfinite_steps": progress.nonfinite_steps,
            "consecutive_bad": progress.consecutive_bad, "timing": timing,
            "layout": self.layout, **membership.stamp()})


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic: a kill mid-write leaves the previous checkpoint intact."""
    atomic_torch_save(state, Path(path))


def load_checkpoint(path: Path) -> dict[str, Any]:
    return read_torch_file(path, "checkpoint", "delete it to start this scenario over")


def saved_config(ckpt: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config, a setting its version did not have at the default it had then."""
    return {**DEFAULTS, **ckpt["config"]}


def check_format(ckpt: Any, path: Path) -> dict[str, Any]:
    """`ckpt` when it is a checkpoint of this format (a torch file of another kind, a bare
    state_dict, is not), else a one-line UserError."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT or \
            not isinstance(ckpt.get("config"), dict):
        raise UserError(f"checkpoint {str(path)!r} has an unknown format; delete it to start over.")
    return ckpt


def check_resumable(ckpt: dict[str, Any], config: TrainConfig, path: Path) -> None:
    check_format(ckpt, path)
    saved = saved_config(ckpt)
    changed = [k for k in RESUME_KEYS if saved[k] != getattr(config, k)]
    if changed:
        diffs = ", ".join(f"{k} {saved[k]!r} -> {getattr(config, k)!r}" for k in changed)
        raise UserError(f"cannot resume from {str(path)!r}: settings changed ({diffs}); "
                        "resume with the options the run was started with (the 'resuming run' "
                        "line names its command), or run without --resume to start over.")


OPTIMIZER_KERNEL_KEYS = ("fused", "foreach", "capturable")


def set_seed(seed: int) -> None:
    """Seed every RNG a run draws from (Python, NumPy, torch on all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, epoch: int = 0) -> int:
    """This process's seed under torchrun, from the run's seed (and, on a resume, the epochs
    done): each rank draws its own augmentation and dropout; rank 0's is the seed itself."""
    rank = distributed.rank()
    return seed + 1_000_003 * rank + 7919 * epoch if rank > 0 else seed


def rng_state() -> dict[str, Any]:
    """Every RNG stream, as tensors and plain numbers so the checkpoint loads weights_only."""
    py_version, py_internal, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {"python": [py_version, torch.tensor(py_internal, dtype=torch.int64), py_gauss],
            "numpy": [torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss),
                      float(np_gauss)],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict[str, Any]) -> None:
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal.tolist()), py_gauss))
    np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state(("MT19937", np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        # One state per GPU the saving process saw: resumed on a machine with fewer (a
        # checkpoint from a multi-GPU node, on Colab), those it has.
        for i, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device=i)


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def save_weights(model: nn.Module, path: Path) -> Path:
    """A model's weights alone, as `--weights PATH` reads them: a tuner's trial, kept so the
    final run can start where the chosen trial ended instead of from the beginning."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save({"state_dict": cpu_state(model), **membership.stamp()}, path)
    return path
