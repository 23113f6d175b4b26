"""Out of memory: recognising it, and the error raised when nothing smaller is left to try.
Shared by the training loop (smaller micro-batches) and evaluation (smaller chunks)."""
from __future__ import annotations

import gc
import math

import torch

from modules.config import UserError

# torch.OutOfMemoryError arrived in torch 2.5; torch.cuda.OutOfMemoryError is the same class
# there (an alias) and the only one before it.
TORCH_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# The share of a GPU's memory a training step is planned to take (hardware.max_batch_size); the
# rest is for what lives beside it (the decoded-image cache, fastdata.cache_on_gpu).
MEMORY_MARGIN = 0.8


class OutOfMemoryError(UserError, TORCH_OOM):
    """Out of memory even with one sample per pass. A UserError, so the command prints one
    line; also a torch OutOfMemoryError (a RuntimeError saying "out of memory"), so code that
    skips candidates which do not fit (the Optuna tuner) still recognises it."""


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA (or any device's) allocator failure; older torch raised a plain RuntimeError, and
    the CPU's allocator still does ("DefaultCPUAllocator: can't allocate memory"), as do
    cuBLAS and cuDNN when their workspace does not fit (CUBLAS_STATUS_ALLOC_FAILED)."""
    text = str(exc).lower() if isinstance(exc, RuntimeError) else ""
    return isinstance(exc, TORCH_OOM) or any(
        sign in text for sign in ("out of memory", "can't allocate memory", "alloc_failed"))


def release(device: torch.device) -> None:
    """Hand the failed pass's cached blocks back before trying smaller pieces. Call it after
    the except block: until then its traceback holds the failed pass's tensors."""
    if device.type == "cuda":
        gc.collect()  # frames of the failed pass left in reference cycles
        torch.cuda.empty_cache()


def more_pieces(splits: int, n: int, message: str) -> int:
    """The pieces a batch of `n` goes through after running out of memory in `splits` pieces:
    twice as many, or OutOfMemoryError(message) when a piece already held a single sample."""
    if math.ceil(n / splits) <= 1:
        raise OutOfMemoryError(message)
    return 2 * splits
