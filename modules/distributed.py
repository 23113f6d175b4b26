"""Several processes through torchrun: the process group, who is rank 0, and sums across ranks.
Outside torchrun (WORLD_SIZE unset or 1) every function is a cheap no-op."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0 alone writes checkpoints, results, plots and logs."""
    return rank() == 0


def init_from_env(device_type: str) -> torch.device | None:
    """Join the process group torchrun describes (gloo on CPU, NCCL on GPU); returns this
    process's device, or None when not launched by torchrun with more than one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_agree(flag: bool, device: torch.device) -> bool:
    """True only when every rank's flag is True: ranks must take the same branch around a
    collective (a skipped backward on one rank alone would hang the others)."""
    if world_size() == 1:
        return flag
    value = torch.tensor(int(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def from_main(value):
    """Rank 0's `value` on every rank (a picklable object); the value itself outside torchrun."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
