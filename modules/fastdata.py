"""The fast data path: decode and resize every image once into a uint8 tensor cache, then
augment whole batches with tensor operations on the training device.

The baseline's path (dataset.ImageListDataset) decodes each JPEG and runs PIL transforms per sample,
every epoch; on a 2-core CPU that costs as much as the model's own step. Here decoding happens
once per (image list, size), and the per-epoch work is one gather, one colour matrix and one
resampling per batch."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from PIL import Image

from modules import distributed, hostmem
from modules.config import IMAGENET_MEAN, IMAGENET_STD, TrainConfig
from modules.dataset import (CHECK_SAID_FROM, Sample, became_unreadable, drops_last, eval_sampler,
                             load_rgb, train_sampler)
from modules.device import resolve_device, usable_cpus
from modules.oom import MEMORY_MARGIN, OutOfMemoryError, is_out_of_memory, release

log = logging.getLogger(__name__)

# Share of the RAM available when the cache is built that decoded images may take.
CACHE_RAM_FRACTION = 0.5
# Share of free GPU memory the cache may take to live on the GPU (else it stays in RAM).
CACHE_GPU_FRACTION = 0.25
# Bytes one augmentation pass holds at once, in multiples of its float32 output (the float
# copy, the colour transform's output, the sampling grid, grid_sample's output, the memory
# format's copy; the previous pass's output is freed by then unless the step still holds it).
PASS_WORKING_SET = 5
# Augmentation ranges, as in dataset.train_transform (RandomResizedCrop scale, ColorJitter 0.2);
# a crop side past the image is clipped, not drawn again (docs/speed.md).
CROP_SCALE = (0.6, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
JITTER = 0.2
_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601 grey, as torchvision's rgb_to_grayscale
PARAM_BATCHES = 64  # training batches whose augmentation parameters are drawn together
# On a GPU, several small batches are gathered and augmented in one pass, up to this many bytes
# of float32 output (8 batches of 32 at 150 px): a small batch on a fast GPU is bound by kernel
# launches, and one pass costs the launches of one batch.
GPU_PASS_BYTES = 100 * 2**20

# (image list, size) -> (the decoded images, their per-channel means)
_MEMO: OrderedDict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_SAID_IN_RAM: set[tuple[int, int]] = set()  # caches logged as kept in RAM
MEANS_CHUNK = 256  # images converted to float at a time while their means are taken


# ----------------------------------------------------------------------------- the cache

def decode_resized(path: str, size: int) -> np.ndarray:
    """One image as a size x size x 3 uint8 array, decoded and resized as the baseline's
    dataset.eval_transform and predict() do: every scenario trains and is tested on the same
    pixels. (A JPEG's draft decode at a reduced DCT scale, used until 2026-12-07, is about 5x
    faster on a 4-megapixel photo but 1-2 levels off on average, up to 39: docs/speed.md.)"""
    try:
        rgb = load_rgb(path)
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.BILINEAR)
        return np.array(rgb, dtype=np.uint8)  # a writable copy, owned by the array
    except Exception as exc:
        raise became_unreadable(path, exc, "while caching") from None


def cache_bytes(n_images: int, size: int) -> int:
    return n_images * 3 * size * size


def _key(samples: list[Sample], size: int) -> tuple[str, int]:
    """The samples' files, in order, by path, size and modification time: images rewritten
    under the same names (a notebook re-run on fixed or other data) are decoded again. The
    files are stated once per split list as it stands (an index makes new lists; a list
    shuffled or changed in place, as a library caller may, is stated again), not at every
    trial: on a network drive a stat of every image costs seconds."""
    paths = "\n".join(p for p, _ in samples)
    order = hashlib.sha1(os.fsencode(paths)).hexdigest()
    held = _STAMPS.get(id(samples))
    if held is None or held[0] is not samples or held[1] != order:
        def stamp(path: str) -> str:
            try:
                st = os.stat(path)
                return f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
            except OSError:
                return path
        digest = hashlib.sha1(os.fsencode("\n".join(stamp(p) for p, _ in samples))).hexdigest()
        held = _STAMPS[id(samples)] = (samples, order, digest)
        while len(_STAMPS) > 16:  # the newest indexes' splits; each entry holds its list
            _STAMPS.pop(next(iter(_STAMPS)))
    return held[2], size


# id(split list) -> (the list, the digest of its paths in order, that of its files): _key
_STAMPS: dict[int, tuple[list, str, str]] = {}


def image_means(images: torch.Tensor) -> torch.Tensor:
    """(N, 3) float32: each uint8 image's mean per channel (the pivot of the contrast jitter),
    taken a chunk at a time so that no float copy of the whole cache is ever made."""
    return torch.cat([chunk.float().mean(dim=(2, 3)) for chunk in images.split(MEANS_CHUNK)]) \
        if len(images) else torch.zeros((0, 3))


def decoded_images(samples: list[Sample], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((N, 3, size, size) uint8 of the samples' images, their (N, 3) image_means), decoded
    once per process and size. The means are taken once here rather than from every augmented
    batch, which would be a pass over each batch every step (docs/speed.md has its cost)."""
    key = _key(samples, size)
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    # NCHW from the start (per-image gathers stay contiguous): permuting an NHWC cache after
    # would hold two copies at once, twice what cache_fits budgeted.
    images = torch.empty((len(samples), 3, size, size), dtype=torch.uint8)

    def fill(i: int) -> None:  # PIL decodes with the GIL released: threads run in parallel
        images[i] = torch.from_numpy(decode_resized(samples[i][0], size)).permute(2, 0, 1)

    started = time.perf_counter()
    if len(samples) >= CHECK_SAID_FROM:  # 5 s for Intel's training split at 150 px, silent
        log.info("decoding %d images once at %d px ...", len(samples), size)
    with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
        list(pool.map(fill, range(len(samples))))
    log.info("decoded %d images once at %d px into a %.0f MB cache in %.1f s", len(samples), size,
             images.numel() / 2**20, time.perf_counter() - started)
    _MEMO[key] = images, image_means(images)
    return _MEMO[key]


def keep_sizes(sizes: set[int]) -> None:
    """Drop the decoded caches at every other size: what a run no longer trains at would
    otherwise stay in memory through its final run (4.8 GB for Intel's train split at the four
    GPU candidate sizes), and count in that run's peak memory."""
    dropped = [k for k in _MEMO if k[1] not in sizes]
    for key in dropped:
        del _MEMO[key]
    if dropped:
        hostmem.release_free()


def clear_cache() -> None:
    _MEMO.clear()
    _STAMPS.clear()
    hostmem.release_free()


# ----------------------------------------------------------------------------- augmentation

_NORMALISERS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _normaliser(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per channel mapping 0..255 to (x / 255 - mean) / std, ImageNet's mean
    and std as the models' weights expect them; made once per device (building a tensor on a
    GPU from Python numbers waits for the GPU's queue)."""
    key = str(device)
    if key not in _NORMALISERS:
        std_t = torch.tensor(IMAGENET_STD, dtype=torch.float32)
        scale = 1.0 / (255.0 * std_t)
        shift = -torch.tensor(IMAGENET_MEAN, dtype=torch.float32) / std_t
        _NORMALISERS[key] = (scale.to(device), shift.to(device))
    return _NORMALISERS[key]


def normalise(x: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> normalised float32, keeping x's memory format."""
    scale, shift = _normaliser(x.device)
    return torch.addcmul(shift.view(1, 3, 1, 1), x.float(), scale.view(1, 3, 1, 1))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without waiting for the GPU's queue (pinned, async); a tensor
    already on the GPU as it is."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _augment_params(n: int, h: int, w: int, generator: torch.Generator) -> torch.Tensor:
    """Every per-image parameter of a batch, computed on the CPU in one go (NumPy on (n,)
    arrays: a few microseconds each, where as many tiny tensor ops would cost a millisecond)
    and packed into one (n, 9 + 9 + 3 + w + h) float32 tensor: colour matrix, contrast matrix
    (row sums times the grey weights), normalise shift, then the sampling grid's x and y
    coordinates."""
    u = torch.rand((n, 8), generator=generator, dtype=torch.float64).numpy()
    # colour: brightness b, contrast c, saturation s, each in 1 +- JITTER as in ColorJitter
    b, c, s = (1 + JITTER * (2 * u[:, k] - 1) for k in range(3))
    luma = np.asarray(_LUMA)
    sat = s[:, None, None] * np.eye(3) + (1 - s)[:, None, None] * luma  # blend toward grey
    mean, std = np.asarray(IMAGENET_MEAN), np.asarray(IMAGENET_STD)  # as _normaliser's
    scale = 1.0 / (255.0 * std)
    matrix = (b * c)[:, None, None] * sat * scale[None, :, None]   # brightness, then contrast
    # contrast pulls toward the image's mean grey m = luma . mean rgb:
    # offset = b (1 - c) m * rowsum(sat) * scale = pivot @ mean rgb, with pivot's rows
    # b (1 - c) rowsum(sat) scale times luma (one batched matmul on the device, not six ops)
    pivot = ((b * (1 - c))[:, None] * sat.sum(2) * scale[None, :])[:, :, None] * luma[None, None, :]
    shift = np.broadcast_to(-mean / std, (n, 3))
    # geometry: a crop of CROP_SCALE of the area at an aspect ratio in CROP_RATIO, resized back,
    # and a horizontal flip; as an axis-aligned sampling grid in [-1, 1] coordinates (built
    # directly: affine_grid's general matmul costs about 4x more)
    area = CROP_SCALE[0] + (CROP_SCALE[1] - CROP_SCALE[0]) * u[:, 3]
    lo, hi = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    ratio = np.exp(lo + (hi - lo) * u[:, 4])
    cw = np.minimum(np.sqrt(area * ratio), 1.0)
    ch = np.minimum(np.sqrt(area / ratio), 1.0)
    flip = np.where(u[:, 7] < 0.5, -1.0, 1.0)
    gx = (cw * flip)[:, None] * ((np.arange(w) * 2 + 1) / w - 1) + ((1 - cw) * (2 * u[:, 5] - 1))[:, None]
    gy = ch[:, None] * ((np.arange(h) * 2 + 1) / h - 1) + ((1 - ch) * (2 * u[:, 6] - 1))[:, None]
    packed = np.concatenate([matrix.reshape(n, 9), pivot.reshape(n, 9), shift, gx, gy], axis=1)
    return torch.from_numpy(packed.astype(np.float32))


def augment_with(x: torch.Tensor, params: torch.Tensor, means: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Random resized crop, horizontal flip and colour jitter of a uint8 batch, normalised,
    with its per-image parameters already drawn (rows of _augment_params, on x's device): the
    loader draws them for many batches at once, and gathers the images' means (image_means)
    from the cache's; without them they are taken from x.

    Brightness, contrast, saturation and normalisation are all affine in the pixel values, so
    they fold into one 3x3 matrix plus offset per image (one batched matmul), then clamped to
    the range of a real pixel (ColorJitter clamps after each of its steps; once at the end
    differs from that only when an intermediate step left the range); the crop and the flip
    are one resampling (grid_sample). The random numbers come from a CPU generator, so a batch
    depends only on the generator's state, on any device. Unlike the per-image path, the three
    colour steps always run in this order, contrast pulls toward the whole image's mean grey
    (not the crop's), and the crop samples the image decoded at the training size."""
    n, _, h, w = x.shape
    matrix, pivot = params[:, :9].view(n, 3, 3), params[:, 9:18].view(n, 3, 3)
    shift = params[:, 18:21]
    gx, gy = params[:, 21:21 + w], params[:, 21 + w:]
    xf = x.float()
    if means is None:
        means = xf.mean(dim=(2, 3))
    offset = torch.baddbmm(shift.unsqueeze(2), pivot, means.unsqueeze(2))
    scale, lowest = _normaliser(x.device)  # a pixel of 0 normalised, and of 255
    xf = torch.baddbmm(offset, matrix, xf.view(n, 3, h * w))
    xf = torch.clamp(xf, min=lowest.view(1, 3, 1), max=(lowest + 255 * scale).view(1, 3, 1))
    xf = xf.view(n, 3, h, w)
    grid = torch.stack([gx.view(n, 1, w).expand(n, h, w), gy.view(n, h, 1).expand(n, h, w)], -1)
    return F.grid_sample(xf, grid, mode="bilinear", padding_mode="border", align_corners=False)


# ----------------------------------------------------------------------------- the loader

class DeferredLoader:
    """A loader built at its first use (len, iteration or any attribute)."""

    data_path = "decoded cache"

    def __init__(self, build: Callable[[], CachedLoader]):
        self._build: Callable[[], CachedLoader] | None = build
        self._loader: CachedLoader | None = None

    def _built(self) -> CachedLoader:
        if self._loader is None:
            self._loader, self._build = self._build(), None
        return self._loader

    def __len__(self) -> int:
        return len(self._built())

    def __iter__(self):
        return iter(self._built())

    def __getattr__(self, name: str):
        if name.startswith("_"):  # its own, before __init__ set them (copy, pickle)
            raise AttributeError(name)
        return getattr(self._built(), name)


class CachedLoader:
    """Batches from a decoded-image cache, augmented (train) or normalised (eval) on `device`.

    Quacks like the DataLoaders the trainer and evaluate() take: len(), iteration over
    (x, y) pairs, and `sampler.set_epoch` for a shuffle that is a function of (seed, epoch)."""

    data_path = "decoded cache"

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, batch_size: int,
                 train: bool, device: torch.device, seed: int, channels_last: bool,
                 pass_batches: int | None = None, means: torch.Tensor | None = None):
        self.images, self.labels = images, labels.to(images.device)
        # the training batches' contrast pivots, gathered with the images (image_means)
        self.means = None if not train else \
            (image_means(images) if means is None else means).to(images.device)
        self.batch_size, self.train, self.device, self.seed = batch_size, train, device, seed
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.sampler = train_sampler(len(labels), seed) if train else eval_sampler(len(labels))
        self.n_local = len(self.sampler) if self.sampler is not None else len(labels)
        self.drop_last = drops_last(self.sampler, batch_size)
        self.pass_batches = batches_per_pass(batch_size, images.shape[-1], device) \
            if pass_batches is None else _param_divisor(pass_batches)

    def __len__(self) -> int:
        full, rest = divmod(self.n_local, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self):
        order = torch.tensor(list(self.sampler) if self.sampler is not None else range(self.n_local),
                             dtype=torch.int64).to(self.images.device)  # one copy per epoch
        epoch = getattr(self.sampler, "epoch", 0)
        # Each rank's own draws under torchrun (rank 0's are one process's).
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * epoch + 1 +
                                                  104_729 * distributed.rank())
        draws = _Draws(generator)
        bs, n_batches = self.batch_size, len(self)
        end = min(self.n_local, n_batches * bs)  # images this epoch yields
        k = 0
        while k < n_batches:
            # One pass gathers and augments `pass_batches` batches (1 on a CPU); the images and
            # their parameters are the same whatever the pass size.
            lo, hi = k * bs, min(end, (k + self.pass_batches) * bs)
            try:
                x, y = self._pass(order[lo:hi], lo, draws)
                failed = False
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                failed = True
            if failed:  # outside the except block, whose traceback holds the failed pass
                self._smaller_passes()
                continue
            draws.used += hi - lo
            k += self.pass_batches
            if hi - lo <= bs:
                yield x, y
            else:  # slices along the batch keep the memory format, without a copy
                yield from zip(x.split(bs), y.split(bs))

    def _pass(self, idx: torch.Tensor, lo: int, draws: _Draws
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The images at `idx` (the epoch's order from position `lo`) and their labels on the
        device, augmented (train) or normalised (eval), in the loader's memory format."""
        x = _to(self.images.index_select(0, idx), self.device)  # to: when the cache is in RAM
        y = _to(self.labels.index_select(0, idx), self.device)
        if self.train:
            n, _, h, w = x.shape
            params = draws.next(n, min(PARAM_BATCHES * self.batch_size, self.n_local - lo),
                                h, w, self.device)
            x = augment_with(x, params, _to(self.means.index_select(0, idx), self.device))
        else:
            x = normalise(x)
        return x.contiguous(memory_format=self.memory_format), y

    def _smaller_passes(self) -> None:
        """After a pass ran out of device memory: passes of half as many batches from then on
        (the batches stay the same); OutOfMemoryError when the pass was a single batch."""
        release(self.device)
        if self.pass_batches == 1:
            where = "cached on the GPU" if self.images.is_cuda else "in RAM"
            raise OutOfMemoryError(
                f"out of memory preparing one batch of {self.batch_size} images at "
                f"{self.images.shape[-1]} px on {self.device} (the decoded images are {where}); "
                "pass a smaller --batch-size.")
        self.pass_batches //= 2
        log.warning("out of memory augmenting a pass of batches on %s; continuing with %d "
                    "batch(es) per pass", self.device, self.pass_batches)


class _Draws:
    """An epoch's augmentation parameters, drawn PARAM_BATCHES batches at a time (one NumPy
    pass and, on a GPU, one copy, instead of one of each per batch). `used` rows are spent: the
    loader counts a pass's rows once the pass succeeded, so a failed pass gets the same rows
    again, and a draw whose copy failed is copied again, not drawn again."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.drawn: torch.Tensor | None = None   # on the CPU, not yet copied to the device
        self.params: torch.Tensor | None = None  # on the device
        self.used = 0

    def next(self, n: int, rows: int, h: int, w: int, device: torch.device) -> torch.Tensor:
        """The next n unspent rows; when fewer are left, a new draw of `rows` rows."""
        if self.params is None or self.used + n > len(self.params):
            if self.drawn is None:
                self.drawn = _augment_params(rows, h, w, self.generator)
            self.params, self.used = _to(self.drawn, device), 0
            self.drawn = None
        return self.params[self.used:self.used + n]


def _param_divisor(n: int) -> int:
    """The largest power of two up to n that divides PARAM_BATCHES: passes of it never straddle
    two draws of parameters, nor do passes of its halves after running out of memory."""
    k = 1
    while k * 2 <= n and PARAM_BATCHES % (k * 2) == 0:
        k *= 2
    return k


def batches_per_pass(batch_size: int, size: int, device: torch.device) -> int:
    """Batches a CachedLoader gathers and augments in one pass: 1 on a CPU (no launches to save,
    and one batch stays in the caches); on a GPU a power of two dividing PARAM_BATCHES, so that
    a pass never straddles two draws of parameters, whose output takes up to GPU_PASS_BYTES."""
    if device.type != "cuda":
        return 1
    batch_bytes = 4 * cache_bytes(batch_size, size)  # float32 where the cache holds uint8
    n = 1
    while n * 2 <= PARAM_BATCHES and n * 2 * batch_bytes <= GPU_PASS_BYTES:
        n *= 2
    return n


def _budget(index, size: int) -> tuple[int, int, int]:
    """(bytes the index's decoded images need at `size`, bytes cached now, the RAM budget), for
    the machine. Under torchrun every process on it holds a whole cache, the same as this
    one's: each counts them all, in what is needed, held and so free to take again."""
    ranks = distributed.local_world_size()
    needed = ranks * sum(cache_bytes(len(s), size) for s in (index.train, index.val, index.test))
    needed += 4 * cache_bytes(min(MEANS_CHUNK, len(index.train)), size)  # image_means' floats
    held = ranks * sum(images.numel() for images, _ in _MEMO.values())
    return needed, held, int(CACHE_RAM_FRACTION * (available_ram() + held))


# (limit, usage, statistics) of a container's memory: cgroup v2, then v1 (whose "no limit" is
# a huge number)
CGROUP_MEMORY_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                        "/sys/fs/cgroup/memory.stat"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                        "/sys/fs/cgroup/memory/memory.stat"))
# Page cache the kernel reclaims before it would refuse the container memory: v1's over the
# hierarchy its usage counts (v1's inactive_file is the group's own), else v2's.
RECLAIMABLE_KEYS = ("total_inactive_file", "inactive_file")


def cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) in bytes of the container's memory (cgroup v2, else v1), or None where
    no limit is set or readable. Usage leaves out the inactive page cache, as Docker's and
    the kubelet's working set do: the container's files read once (pip's wheels, an unzipped
    data set) count in its usage, and left in, they shrank the decoded cache's budget to a
    fraction and sent the tuned scenarios to stream from disk."""
    for limit_file, usage_file, stat_file in CGROUP_MEMORY_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit == "max":
                continue
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        return int(limit), max(0, usage - _reclaimable(stat_file))
    return None


def _reclaimable(stat_file: str) -> int:
    try:
        stats = dict(line.split()[:2] for line in Path(stat_file).read_text().splitlines()
                     if len(line.split()) >= 2)
        return next((int(stats[k]) for k in RECLAIMABLE_KEYS if k in stats), 0)
    except (OSError, ValueError):
        return 0


def available_ram() -> int:
    """Bytes of RAM this process may still take: the machine's available memory, or less
    where a container's memory limit leaves less."""
    available = psutil.virtual_memory().available
    cgroup = cgroup_memory()
    if cgroup is not None and 0 <= cgroup[0] - cgroup[1] < available:
        return cgroup[0] - cgroup[1]
    return available


def total_ram() -> int:
    """Bytes of RAM this process may take in all: the machine's, or a container's limit."""
    total, cgroup = psutil.virtual_memory().total, cgroup_memory()
    return min(total, cgroup[0]) if cgroup else total


def cache_fits(index, size: int) -> bool:
    """Whether the index's decoded images at `size` fit in the cache's RAM budget."""
    needed, _, budget = _budget(index, size)
    return needed <= budget


def cache_on_gpu(needed: int, free: int, total: int, batch_bytes: int = 0) -> bool:
    """Whether `needed` bytes of decoded images may live on a GPU with `free` of its `total`
    bytes free: within CACHE_GPU_FRACTION of the free memory, and within what a training step
    planned to MEMORY_MARGIN of the whole (the memory probe's batch) leaves beside it, less one
    augmentation pass (up to GPU_PASS_BYTES of output, or one batch of `batch_bytes` uint8
    images when that is more). Else the cache stays in RAM, and each batch is copied over."""
    pass_bytes = max(GPU_PASS_BYTES, 4 * batch_bytes)  # float32 output of uint8 input
    beside_step = (1 - MEMORY_MARGIN) * total - PASS_WORKING_SET * pass_bytes
    return needed <= min(CACHE_GPU_FRACTION * free, beside_step)


def cached_loaders(index, config: TrainConfig, test: bool = True
                   ) -> tuple[CachedLoader | None, ...] | None:
    """(train, val, test) CachedLoaders (test None unless `test`), or None when the decoded
    images would not fit in the RAM budget (the caller then streams from disk). The budget
    counts the test images either way, so a trial and its final run take the same path."""
    size = config.image_size
    every = (index.train, index.val, index.test)
    splits = every if test else every[:2]
    needed, held, budget = _budget(index, size)
    device = resolve_device(config.device)
    # Under torchrun every rank takes the same path (each measures its own free RAM): one that
    # streamed beside others that cache would train on another pipeline than rank 0 records.
    if distributed.any_rank([needed > budget], device)[0]:
        log.info("decoded-image cache would need %.1f GB at %d px, over its budget of %.1f GB "
                 "(%.0f%% of available RAM): streaming images from disk instead.",
                 needed / 1e9, size, budget / 1e9, 100 * CACHE_RAM_FRACTION)
        return None
    keys = {_key(s, size) for s in splits}
    ranks = distributed.local_world_size()
    new_bytes = ranks * sum(cache_bytes(len(s), size) for s in splits
                            if _key(s, size) not in _MEMO)
    evicted = False
    for key in [k for k in _MEMO if k not in keys]:  # least recently used first
        if held + new_bytes <= budget:
            break
        held -= ranks * _MEMO.pop(key)[0].numel()
        evicted = True
    if evicted:
        hostmem.release_free()
    on_gpu = False
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Blocks torch holds but no tensor uses (a trial or probe before this one) are free
        # to this process, though the driver counts them as taken.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        own = sum(cache_bytes(len(s), size) for s in every)  # this process's, test included
        on_gpu = cache_on_gpu(own, free, total, cache_bytes(config.batch_size, size))
        if not on_gpu and (own, size) not in _SAID_IN_RAM:  # once, not at every trial
            _SAID_IN_RAM.add((own, size))
            log.info("decoded-image cache (%.0f MB at %d px) kept in RAM, each batch copied to "
                     "the GPU: it needs more than %.0f%% of the GPU's free %.0f MB or what a "
                     "training step planned to %.0f%% of its %.0f MB leaves", own / 2**20,
                     size, 100 * CACHE_GPU_FRACTION, free / 2**20, 100 * MEMORY_MARGIN,
                     total / 2**20)
    def loader(samples: list, train: bool) -> CachedLoader:
        images, means = decoded_images(samples, size)
        labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
        moved = None
        if on_gpu:
            try:
                moved = images.to(device), means.to(device)
            except RuntimeError as exc:  # the test split after training: what it left held
                if not is_out_of_memory(exc):
                    raise
            if moved is None:
                release(device)  # batches are then copied from RAM, as a cache kept there is
                log.info("decoded-image cache of %d images at %d px: the GPU had no room for "
                         "it after all; kept in RAM, each batch copied", len(samples), size)
            else:
                images, means = moved
        return CachedLoader(images, labels, batch_size=config.batch_size, train=train,
                            device=device, seed=config.seed, channels_last=config.channels_last,
                            means=means)
    loaders = [loader(index.train, True), loader(index.val, False)]
    # The test split is decoded at the test pass, after training: its decode is that pass's
    # cost (as the streamed baseline's is), not the run's preparation.
    return (*loaders, DeferredLoader(lambda: loader(index.test, False)) if test else None)
