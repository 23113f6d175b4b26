"""Trains a small deterministic model (no dropout, no BatchNorm, no augmentation) with
modules.trainer.train, in order, and saves the final weights and history: run under torchrun
with a per-process batch B, or as one process with batch B x processes, the same global batches
are seen, so the weights must agree (tests/test_distributed.py).

    ddp_same_as_one_process.py OUT B [CASE ...]

Each CASE is one training from scratch, in turn in the same processes (one launch serves
several checks), saved to OUT.CASE.rank<r>.pt: `none` trains as it is; a rank number makes
that rank alone run out of memory once, in its third forward pass: it replays its
micro-batches in halves while the other rank waits, and the weights must still agree. Without
a CASE: `none` alone. Imported, train_case is the one-process training (outside torchrun)."""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from modules import distributed
from modules.config import TrainConfig
from modules.dataset import eval_sampler
from modules.trainer import train


def train_case(out: str, batch_size: int, case: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 3, 8, 8)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0].mean(dim=(1, 2)) > 0).long()
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 3))
    model.num_classes = 3
    oom_rank = None if case == "none" else int(case)
    if oom_rank == distributed.rank():
        calls = [0]

        def out_of_memory_once(module, inputs):
            calls[0] += 1
            if calls[0] == 3:
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

        model.register_forward_pre_hook(out_of_memory_once)
    # In order: under torchrun rank r takes samples r, r + world, ..., so its batch k and the
    # other ranks' together are exactly one process's batch k of batch_size x world.
    train_loader = DataLoader(TensorDataset(x[:48], y[:48]), batch_size=batch_size,
                              sampler=eval_sampler(48))
    val_loader = DataLoader(TensorDataset(x[48:], y[48:]), batch_size=batch_size,
                            sampler=eval_sampler(16))
    config = TrainConfig(epochs=3, batch_size=batch_size, grad_accum_steps=2, lr=0.05,
                         optimizer="sgd", scheduler="none", amp="off", device="cpu",
                         progress=False, seed=0, max_nonfinite_steps=1000)
    result = train(model, train_loader, val_loader, config)
    torch.save({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "val_loss": [r["val_loss"] for r in result.history],
                "oom_recoveries": result.settings["oom_recoveries"]},
               f"{out}.{case}.rank{distributed.rank()}.pt")


if __name__ == "__main__":
    out, batch_size = sys.argv[1], int(sys.argv[2])
    distributed.init_from_env("cpu")
    for case in sys.argv[3:] or ["none"]:
        train_case(out, batch_size, case)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
