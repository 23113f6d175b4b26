"""The loaders a training run reads: the decoded-image cache with batched augmentation on the
device (modules.fastdata) when it fits, else the baseline's per-sample PIL path
(modules.dataset). Above both, so neither imports the other."""
from __future__ import annotations

from torch.utils.data import DataLoader

from modules.config import TrainConfig
from modules.dataset import DatasetIndex, eval_transform, make_loader, train_transform
from modules.fastdata import cached_loaders


def make_loaders(index: DatasetIndex, config: TrainConfig, test: bool = True
                 ) -> tuple[DataLoader, DataLoader, DataLoader | None]:
    """(train, val, test) loaders at config.image_size: from the decoded-image cache with batched
    augmentation on the device when config.cache_decoded (and it fits in RAM), else the baseline's
    per-sample PIL decode and transforms. test=False: no test loader (None), for a tuning trial,
    which never tests: the cache would decode the test images at every size tried."""
    if config.cache_decoded:
        loaders = cached_loaders(index, config, test=test)
        if loaders is not None:
            return loaders
    size = config.image_size
    return (make_loader(index.train, train_transform(size), config, train=True),
            make_loader(index.val, eval_transform(size), config, train=False),
            make_loader(index.test, eval_transform(size), config, train=False) if test else None)
