"""Evaluation beside training: loss, accuracy, per-class accuracy and the confusion matrix of a
model over a loader, in pieces when memory runs out, summed across processes under torchrun."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassConfusionMatrix
from tqdm.auto import tqdm

from modules import distributed, interrupts
from modules.device import library_device
from modules.models import num_classes_of
from modules.oom import is_out_of_memory, more_pieces, release

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, device: torch.device | str | None = None,
             amp_dtype: torch.dtype | None = None, channels_last: bool = False,
             num_classes: int | None = None, pieces: int = 1,
             progress: str | None = None) -> dict[str, Any]:
    """Loss, accuracy, per-class accuracy and confusion matrix of `model` over `loader`.

    A batch that runs out of memory is run again in halves (then quarters ...) for the rest of
    the call, each halving said in the log; the figures do not depend on the pieces.
    pieces: what each batch is cut into from the start, as an earlier call returned it in
    "pieces" (the trainer's every epoch: else each epoch's validation runs out of memory again).
    device: as load_model takes it ("auto" too), where the model is moved, as predict() does;
    None runs where the model's weights are.
    progress: the label of a progress bar over the batches (removed when done); None, no bar."""
    if device is None:
        device = next(model.parameters()).device
    else:
        device = library_device(device)
        model.to(device)
    num_classes = int(num_classes or num_classes_of(model))
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    # Summed across processes below, only when each evaluated its own share (torchmetrics
    # would otherwise sum whole copies under torchrun). Predictions are an argmax and labels
    # the loader's: checking them would wait for the GPU at every batch.
    # A row of non-finite logits (fp16 overflow, a diverged model) is no prediction: argmax
    # would read NaN as the largest and score it class 0. It is left out of the confusion
    # matrix (ignore_index) and counted wrong, for its class, in `unscored`.
    confusion = MulticlassConfusionMatrix(num_classes=num_classes, sync_on_compute=False,
                                          validate_args=False, ignore_index=-1).to(device)
    unscored = torch.zeros(num_classes, device=device, dtype=torch.float64)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    was_training = model.training
    model.eval()
    splits = max(1, int(pieces))
    # a count, not a wrapper of the loader: tqdm(loader) draws from torch's generator (a
    # DataLoader's seed), and the training after it would differ with the bars
    bar = tqdm(total=len(loader), desc=progress, leave=False, disable=progress is None,
               dynamic_ncols=True)
    try:
        for x, y in loader:
            interrupts.check()
            bar.update()
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
            scored = torch.isfinite(logits).all(dim=1)  # no host sync: masks, not indexing
            # an unscored image's loss (NaN, inf) would make the split's NaN: left out, as from
            # the accuracy
            loss_sum += torch.where(scored, F.cross_entropy(logits.float(), y, reduction="none"),
                                    0.0).sum()
            confusion.update(logits.nan_to_num(0.0), torch.where(scored, y, -1))
            unscored += (F.one_hot(y, num_classes) * (~scored).unsqueeze(1)).sum(dim=0)
    finally:
        bar.close()
        model.train(was_training)
    matrix = confusion.compute()
    if getattr(getattr(loader, "sampler", None), "sharded", False):
        # Under torchrun each process evaluated its own share (EvalShard): sum the shares.
        distributed.all_reduce_sum(matrix)
        distributed.all_reduce_sum(loss_sum)
        distributed.all_reduce_sum(unscored)
    matrix, unscored = matrix.cpu(), unscored.cpu()
    per_class_n = matrix.sum(dim=1).double() + unscored
    total = int(per_class_n.sum())
    if total == 0:
        return {"loss": float("nan"), "acc": float("nan"), "per_class_acc": [], "confusion": [],
                "n": 0, "unscored": 0, "pieces": splits}
    # A class without images in this split has no accuracy (NaN, null in results.json),
    # not 0%: with a seeded split of a tiny class it happens.
    per_class = matrix.diag().double() / per_class_n
    n_scored = total - int(unscored.sum())
    return {"loss": loss_sum.item() / n_scored if n_scored else float("nan"),
            "acc": matrix.diag().sum().item() / total,
            "per_class_acc": per_class.tolist(), "confusion": matrix.tolist(), "n": total,
            "unscored": int(unscored.sum()), "pieces": splits}


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
