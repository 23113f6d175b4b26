"""Several processes through torchrun: the process group, who is rank 0, and sums across ranks.
Outside torchrun (WORLD_SIZE unset or 1) every function is a cheap no-op."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from modules.config import UserError, first_line

# How long a rank waits at a collective for the others. Rank 0 alone measures the speed knobs
# (bounded by a share of the planned training time) while the others wait for its choice.
TIMEOUT = timedelta(hours=1)
BUCKET_BYTES = 25 << 20  # gradients all-reduced together, as DDP's default bucket


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_world_size() -> int:
    """Processes on this machine: torchrun's LOCAL_WORLD_SIZE, 1 outside a process group."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if world_size() > 1 else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0 alone writes checkpoints, results, plots and logs."""
    return rank() == 0


def launched_main() -> bool:
    """Whether torchrun launched this process as rank 0 (or no torchrun did), before the
    process group is joined: for what is said once per run, such as a warning about options."""
    return os.environ.get("RANK", "0") == "0"


def init_from_env(device_type: str) -> torch.device | None:
    """Join the process group torchrun describes (gloo on CPU, NCCL on GPU); returns this
    process's device, or None when not launched by torchrun with more than one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_type == "cuda" and local_processes > torch.cuda.device_count():
        # Checked by every process before joining, so all of them stop in one line rather
        # than the extra ones on "invalid device ordinal" and the rest waiting for them.
        raise UserError(f"torchrun started {local_processes} processes on this machine, which "
                        f"has {torch.cuda.device_count()} GPU(s): pass --nproc-per-node "
                        f"{torch.cuda.device_count()} (or fewer), one process per GPU")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                timeout=TIMEOUT)
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag set where any rank has it set (the ranks' lists are as long): ranks that act
    on them take the same branch."""
    if world_size() == 1 or not flags:
        return flags
    tensor = torch.tensor(flags, dtype=torch.uint8, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def same_on_every_rank(value) -> bool:
    """Whether every rank holds `value` (picklable and comparable); every rank gets the same
    answer, so all of them act on it alike."""
    if world_size() == 1:
        return True
    values: list = [None] * world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


# gloo's words when the process at the other end of a collective has exited
PEER_LEFT = ("Connection closed by peer", "Connection reset by peer")


def peer_left(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another process of the run stopped
    (its own error, said on its side, is the one to read)."""
    return world_size() > 1 and isinstance(exc, RuntimeError) and \
        any(words in str(exc) for words in PEER_LEFT)


@dataclass(frozen=True)
class Failed:
    """What rank 0 sends where the other ranks wait for a value (from_main) when the work that
    makes it failed: they stop with its first line instead of at the next collective, a
    connection closed by a rank 0 that has left, with a traceback."""
    message: str


def expect(value):
    """A value from rank 0 (from_main), or its failure raised here as the user's error."""
    if isinstance(value, Failed):
        raise UserError(value.message)
    return value


def main_computes(action):
    """action() on rank 0, its value on every rank (from_main; outside torchrun, the value).
    When it fails, every rank stops: rank 0 with its error, the others with its first line,
    rather than at the next collective, a connection closed by a rank 0 that has left."""
    if not is_main():
        return expect(from_main(None))
    try:
        value = action()
    except Exception as exc:  # re-raised on rank 0 as it was
        tell_the_others(exc)
        raise
    return from_main(value)


def tell_the_others(exc: Exception) -> None:
    """Rank 0's failure, sent where the other ranks wait for a value from it; not when it
    struck inside a tuning trial (`amid_trial`), where they wait in its training's
    collectives instead."""
    if world_size() > 1 and not getattr(exc, "amid_trial", False):
        from_main(Failed(first_line(exc, limit=1000)))  # whole: it says what to do at its end


def from_main(value):
    """Rank 0's `value` on every rank (a picklable object); the value itself outside torchrun."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_state(model: nn.Module, *, buffers_only: bool = False) -> None:
    """Rank 0's parameters and buffers on every rank: every rank starts a run as rank 0, and
    after each step takes rank 0's buffers (BatchNorm statistics), as DDP does."""
    if world_size() == 1:
        return
    # One broadcast per dtype and device, not one per tensor: buffers go after every step,
    # and a BatchNorm network has a hundred of them. Flattened in logical order, so a
    # channels_last weight arrives as it was sent.
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in [*([] if buffers_only else model.parameters()), *model.buffers()]:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor.data)
    for tensors in groups.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=0)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()


def average_gradients(model: nn.Module) -> None:
    """Every rank's gradients replaced by their mean over the ranks, once per optimizer step,
    in buckets of about BUCKET_BYTES (one all-reduce each).

    Done here after the step's micro-batches rather than by DDP's hooks during the last
    backward: a rank that ran out of memory replays its micro-batches in smaller pieces (more
    backward passes than the other ranks), which DDP cannot allow, since its hooks are
    collectives every rank must reach equally often. Each rank splits its own batches as its
    memory needs; the ranks meet here once per step whatever they did. The cost is that the
    all-reduce no longer overlaps the backward pass."""
    if world_size() == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for i, grad in enumerate(grads):
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= BUCKET_BYTES or i == len(grads) - 1:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= world_size()
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = [], 0
