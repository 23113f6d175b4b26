"""The fast data path: decoded uint8 cache, batched augmentation, the cached loader."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from modules import fastdata
from modules.config import IMAGENET_MEAN, IMAGENET_STD, TrainConfig, UserError
from modules.dataset import index_dataset
from modules.loaders import make_loaders
from modules.oom import TORCH_OOM, OutOfMemoryError
from modules.fastdata import CachedLoader, augment_with, normalise


@pytest.fixture(autouse=True)
def fresh_cache():
    fastdata.clear_cache()
    yield
    fastdata.clear_cache()


def test_decoding_a_large_split_is_said_as_it_starts(folder, monkeypatch, caplog):
    """Intel's training split takes 5 s at 150 px on two cores (more on Drive), silent until
    its 'decoded' line; a small split says only that line."""
    index = index_dataset(folder)
    monkeypatch.setattr(fastdata, "CHECK_SAID_FROM", len(index.train))
    with caplog.at_level(logging.INFO, logger="modules.fastdata"):
        fastdata.decoded_images(index.train, 16)
        fastdata.decoded_images(index.test, 16)
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"decoding {len(index.train)} images once at 16 px ..."
    assert [line.split(" images")[0] for line in said[1:]] == \
        [f"decoded {len(index.train)}", f"decoded {len(index.test)}"]


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One batch augmented with parameters drawn from `generator`, as the loader draws them."""
    n, _, h, w = x.shape
    return augment_with(x, fastdata._augment_params(n, h, w, generator))


def _batch(n=16, size=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)


def test_augment_shape_dtype_and_determinism():
    x = _batch()
    a = augment(x, torch.Generator().manual_seed(1))
    b = augment(x, torch.Generator().manual_seed(1))
    c = augment(x, torch.Generator().manual_seed(2))
    assert a.shape == (16, 3, 24, 24) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_augment_without_jitter_or_crop_is_normalise_or_its_mirror(monkeypatch):
    monkeypatch.setattr(fastdata, "JITTER", 0.0)
    monkeypatch.setattr(fastdata, "CROP_SCALE", (1.0, 1.0))
    monkeypatch.setattr(fastdata, "CROP_RATIO", (1.0, 1.0))
    x = _batch(n=32)
    out = augment(x, torch.Generator().manual_seed(0))
    plain = normalise(x)
    same = [torch.allclose(o, p, atol=1e-4) for o, p in zip(out, plain)]
    mirrored = [torch.allclose(o, p.flip(-1), atol=1e-4) for o, p in zip(out, plain)]
    assert all(s or m for s, m in zip(same, mirrored))
    assert any(same) and any(mirrored)  # both flip outcomes occur in 32 draws


def test_the_random_crop_varies_in_size_and_position(monkeypatch):
    """RandomResizedCrop's point is to show the model other framings of each image: crops of
    CROP_SCALE of the area, anywhere in the image, not the whole image or always its centre.
    Channel 0 rises 10 levels a column and channel 1 a row, so a crop's spread of levels is
    its width (height) and its mean level its centre."""
    monkeypatch.setattr(fastdata, "JITTER", 0.0)
    n, size = 32, 24
    ramp = torch.arange(size) * 10
    x = torch.full((n, 3, size, size), 100, dtype=torch.uint8)
    x[:, 0] = ramp.view(1, size)
    x[:, 1] = ramp.view(size, 1)
    out = augment(x, torch.Generator().manual_seed(0))
    plain = normalise(x)
    reframed = [not torch.allclose(o, p, atol=1e-4) and not torch.allclose(o, p.flip(-1), atol=1e-4)
                for o, p in zip(out, plain)]
    assert sum(reframed) > n // 2
    pixels, full = in_pixels(out), 10 * (size - 1)
    smallest = (fastdata.CROP_SCALE[0] * fastdata.CROP_RATIO[0]) ** 0.5
    for channel in (0, 1):  # width, then height
        levels = pixels[:, channel].flatten(1)
        sides = (levels.amax(1) - levels.amin(1)) / full
        assert sides.min() >= smallest - 1e-3 and sides.max() <= 1 + 1e-3
        assert (sides < 0.9).sum() > n // 4
        centres = levels.mean(1) / 10  # in pixels; the image's own centre is 11.5
        assert centres.max() - centres.min() > 2


def jittered_flat(level: int, monkeypatch) -> torch.Tensor:
    """64 flat images of one grey `level`, colour-jittered without a crop, back in 0..255."""
    monkeypatch.setattr(fastdata, "CROP_SCALE", (1.0, 1.0))
    monkeypatch.setattr(fastdata, "CROP_RATIO", (1.0, 1.0))
    flat = torch.full((64, 3, 8, 8), level, dtype=torch.uint8)
    return in_pixels(augment(flat, torch.Generator().manual_seed(0)))


def in_pixels(out: torch.Tensor) -> torch.Tensor:
    """A normalised batch back in 0..255."""
    std = torch.tensor(fastdata.IMAGENET_STD).view(1, 3, 1, 1)
    mean = torch.tensor(fastdata.IMAGENET_MEAN).view(1, 3, 1, 1)
    return (out * std + mean) * 255


def test_colour_jitter_is_bounded_brightness_contrast_saturation(monkeypatch):
    # a flat grey image stays grey (saturation and contrast keep it), and only brightness
    # moves it, by at most JITTER
    pixels = jittered_flat(100, monkeypatch)
    assert torch.allclose(pixels, pixels[:, :1], atol=1e-3)          # still grey
    level = pixels[:, 0, 0, 0]
    assert level.min() >= 100 * (1 - fastdata.JITTER) - 1e-3
    assert level.max() <= 100 * (1 + fastdata.JITTER) + 1e-3
    assert level.std() > 1  # and it does vary


def test_a_brightened_pixel_stays_a_pixel(monkeypatch):
    """ColorJitter clamps to the image range: a bright image (snow, sky) brightened by 20% is
    white, not 1.2x white, which no test image holds."""
    pixels = jittered_flat(240, monkeypatch)
    assert pixels.max() <= 255 + 1e-3 and pixels.min() >= -1e-3
    assert (pixels > 254.99).any()  # brightened past white: clamped there


def test_saturation_jitter_moves_each_pixels_colour_toward_or_away_from_its_grey(monkeypatch):
    """ColorJitter's saturation, which flat grey images cannot show: a red top half over a grey
    bottom half. Brightness and contrast scale a pixel's colour (R - G) and the grey step
    between the halves alike; saturation scales the colour alone, by 1 +- JITTER per draw."""
    monkeypatch.setattr(fastdata, "CROP_SCALE", (1.0, 1.0))
    monkeypatch.setattr(fastdata, "CROP_RATIO", (1.0, 1.0))
    x = torch.full((64, 3, 8, 8), 80, dtype=torch.uint8)
    x[:, :, :4] = torch.tensor([150, 100, 100], dtype=torch.uint8).view(1, 3, 1, 1)
    luma = torch.tensor(fastdata._LUMA).view(1, 3)

    def colour_over_grey_step(pixels):
        top, bottom = pixels[:, :, 0, 0], pixels[:, :, -1, 0]
        return (top[:, 0] - top[:, 1]) / ((top - bottom) * luma).sum(1)
    before = colour_over_grey_step(x.float())
    saturation = colour_over_grey_step(in_pixels(augment(x, torch.Generator().manual_seed(0))))
    saturation = saturation / before
    assert saturation.min() >= 1 - fastdata.JITTER - 1e-3
    assert saturation.max() <= 1 + fastdata.JITTER + 1e-3
    assert saturation.std() > 0.05


def _config(**kw):
    base = dict(image_size=24, batch_size=5, device="cpu", cache_decoded=True, weights="none")
    return TrainConfig(**{**base, **kw})


def test_cached_loaders_match_the_pil_loaders_in_shape_order_and_values(folder):
    index = index_dataset(folder)
    cached = make_loaders(index, _config(image_size=32, channels_last=True))
    pil = make_loaders(index, _config(image_size=32, cache_decoded=False))
    assert all(isinstance(c, CachedLoader) for c in cached[:2])
    assert isinstance(cached[2], fastdata.DeferredLoader)  # built at the test pass
    assert all(isinstance(p, DataLoader) for p in pil)
    for c, p in zip(cached, pil):
        assert len(c) == len(p)
    x, y = next(iter(cached[0]))
    assert x.shape == (5, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)
    # evaluation batches: same order and labels; same pixels at the images' own size (32 px)
    for (xc, yc), (xp, yp) in zip(cached[1], pil[1]):
        assert torch.equal(yc, yp)
        assert torch.allclose(xc, xp, atol=2e-2)


def test_cached_shuffle_depends_only_on_seed_and_epoch(folder):
    index = index_dataset(folder)
    train, _, _ = make_loaders(index, _config())
    labels = lambda: torch.cat([y for _, y in train])  # noqa: E731
    first, again = labels(), labels()
    assert torch.equal(first, again)
    train.sampler.set_epoch(1)
    batches = [x for x, _ in train]
    train.sampler.set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(batches, [x for x, _ in train]))
    assert not torch.equal(labels(), first) or len(first) < 3


@pytest.mark.parametrize("train", [True, False])
def test_a_pass_of_several_batches_yields_the_batches_of_one_at_a_time(train):
    """On a GPU several batches are gathered and augmented in one pass (fewer launches): the
    batches, their pixels, labels and memory format are those of one batch per pass."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8 * fastdata.PARAM_BATCHES + 13, 3, 12, 12), dtype=torch.uint8,
                           generator=g)
    labels = torch.randint(0, 6, (len(images),), generator=g)

    def batches(pass_batches):
        loader = CachedLoader(images, labels, batch_size=4, train=train, device=torch.device("cpu"),
                              seed=3, channels_last=True, pass_batches=pass_batches)
        if train:
            loader.sampler.set_epoch(2)
        return list(loader)

    one, eight = batches(1), batches(8)
    assert len(one) == len(eight) == len(CachedLoader(
        images, labels, batch_size=4, train=train, device=torch.device("cpu"), seed=3,
        channels_last=False))
    for (xa, ya), (xb, yb) in zip(one, eight):
        assert torch.equal(ya, yb) and xa.shape == xb.shape
        assert xb.is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(xa, xb, atol=1e-5)


def test_the_cached_means_give_the_batches_their_own_means_would(folder, monkeypatch):
    """The contrast pivots come from each image's mean, taken once when the cache is built (a
    chunk at a time) instead of from every batch: the batches are those of means taken from
    the batch itself."""
    monkeypatch.setattr(fastdata, "MEANS_CHUNK", 3)  # several chunks, the last one short
    images = _batch(n=11, size=20, seed=4)
    assert torch.allclose(fastdata.image_means(images), images.float().mean(dim=(2, 3)))
    assert fastdata.image_means(images[:0]).shape == (0, 3)
    index = index_dataset(folder)
    train = make_loaders(index, _config())[0]
    cached, means = fastdata.decoded_images(index.train, 24)
    assert train.images is cached and torch.equal(train.means, means)
    assert torch.allclose(means, cached.float().mean(dim=(2, 3)))
    seen = []
    real = fastdata.augment_with
    monkeypatch.setattr(fastdata, "augment_with", lambda x, params, means=None: seen.append(
        (x, params, means)) or real(x, params, means))
    batches = [x for x, _ in train]
    assert len(seen) == len(batches) and all(m is not None for _, _, m in seen)
    for out, (x, params, m) in zip(batches, seen):
        assert torch.allclose(m, x.float().mean(dim=(2, 3)))
        assert torch.allclose(out, real(x, params), atol=1e-5)  # means from the batch itself


def test_passes_are_one_batch_on_a_cpu_and_up_to_100_mb_on_a_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert fastdata.batches_per_pass(32, 150, cpu) == 1
    assert [fastdata.batches_per_pass(b, 150, gpu) for b in (1, 32, 48, 64, 256, 512)] == \
        [64, 8, 8, 4, 1, 1]
    assert fastdata.batches_per_pass(32, 512, gpu) == 1   # 100 MB a batch already
    assert fastdata.batches_per_pass(32, 64, gpu) == 64   # PARAM_BATCHES at most
    for b in (1, 3, 32, 48, 100):  # a pass never straddles two draws of parameters
        assert fastdata.PARAM_BATCHES % fastdata.batches_per_pass(b, 96, gpu) == 0


def test_every_split_is_decoded_as_the_baseline_decodes_it(tmp_path):
    """JPEGs twice the input size or more, where a reduced-scale (draft) decode would be
    faster: every split of the cache holds the pixels the baseline's loader and predict() give,
    so that the scenarios train and are tested on the same images."""
    import numpy as np
    from PIL import Image

    from modules.dataset import eval_transform, load_rgb
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for label in ("a", "b"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(6):
                pixels = rng.integers(0, 255, (160, 200, 3), np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / label / f"{i}.jpg", quality=90)
    index = index_dataset(tmp_path)
    _, val, test = make_loaders(index, _config(image_size=32))
    transform = eval_transform(32)
    mean = torch.tensor(IMAGENET_MEAN)[:, None, None]
    std = torch.tensor(IMAGENET_STD)[:, None, None]
    for loader, samples in ((val, index.val), (test, index.test)):
        x = torch.cat([xb for xb, _ in loader])
        want = torch.stack([transform(load_rgb(p)) for p, _ in samples])
        assert torch.allclose(x, want, atol=1e-5)
        drafted = torch.stack([transform(load_rgb(p, draft=32)) for p, _ in samples])
        assert (x - drafted).abs().max() > 0.05
    cached, _ = fastdata.decoded_images(index.train, 32)
    want = torch.stack([transform(load_rgb(p)) for p, _ in index.train])
    assert torch.allclose((cached.float() / 255 - mean) / std, want, atol=1e-5)


def test_images_are_decoded_once_per_size(folder, monkeypatch):
    index = index_dataset(folder)
    calls = []
    real = fastdata.decode_resized
    monkeypatch.setattr(fastdata, "decode_resized", lambda p, s: calls.append(s) or real(p, s))
    def every_split(config):
        *_, test = make_loaders(index, config)
        len(test)  # the test split is decoded at its first use
    every_split(_config())
    n = len(calls)
    assert n == len(index.train) + len(index.val) + len(index.test)
    every_split(_config(batch_size=7))
    assert len(calls) == n          # cached
    every_split(_config(image_size=20))
    assert len(calls) == 2 * n      # a new size decodes again


def test_a_tuning_trial_does_not_decode_the_test_images(folder, monkeypatch):
    """fit() never tests, yet every size a tuner tried decoded the test split too (about 0.4-0.8
    s a size on Animal-MNIST's 1,941 and ELPV's 658 test images here; Intel's 3,000 JPEGs more)."""
    from modules.trainer import fit
    index = index_dataset(folder)
    calls = []
    real = fastdata.decode_resized
    monkeypatch.setattr(fastdata, "decode_resized", lambda p, s: calls.append(p) or real(p, s))
    fit(index, _config(epochs=1, progress=False))
    assert len(calls) == len(index.train) + len(index.val)
    assert not {path for path, _ in index.test} & set(calls)
    # the final run's test split: decoded at the test pass, after training (its decode is
    # that pass's cost, as the streamed baseline's is, not the run's preparation)
    *_, test = make_loaders(index, _config())
    assert test is not None and len(calls) == len(index.train) + len(index.val)
    assert sum(len(y) for _, y in test) == len(index.test)
    assert len(calls) == len(index.train) + len(index.val) + len(index.test)


def test_over_budget_streams_from_disk_and_says_so(folder, monkeypatch, caplog):
    monkeypatch.setattr(fastdata, "CACHE_RAM_FRACTION", 1e-12)
    index = index_dataset(folder)
    with caplog.at_level(logging.INFO, logger="modules.fastdata"):
        loaders = make_loaders(index, _config())
    assert all(isinstance(l, DataLoader) for l in loaders)
    lines = [r.getMessage() for r in caplog.records if "streaming" in r.getMessage()]
    assert len(lines) == 1 and "budget" in lines[0]


def test_an_image_that_breaks_before_caching_is_a_clear_error(folder):
    index = index_dataset(folder)
    broken = index.train[0][0]
    with open(broken, "wb") as f:
        f.write(b"not a jpeg any more")
    with pytest.raises(UserError, match="unreadable while caching"):
        make_loaders(index, _config())


def test_training_on_the_cached_path_learns(folder):
    from modules.trainer import fit
    index = index_dataset(folder)
    result = fit(index, _config(image_size=32, epochs=8, lr=3e-3, batch_size=6, progress=False))
    assert result.best_val_acc >= 0.6  # three colour classes; chance is 1/3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cached_loader_on_the_gpu_keeps_the_cache_there_and_matches_the_cpu(folder):
    index = index_dataset(folder)
    gpu = make_loaders(index, _config(device="cuda", channels_last=True))
    cpu = make_loaders(index, _config(device="cpu", channels_last=True))
    assert gpu[0].images.device.type == "cuda"      # small: the cache lives in GPU memory
    for (xg, yg), (xc, yc) in zip(gpu[0], cpu[0]):  # same order, same augmentation numbers
        assert xg.device.type == "cuda" and torch.equal(yg.cpu(), yc)
        assert torch.allclose(xg.cpu(), xc, atol=1e-3)


@pytest.mark.parametrize("train", [True, False])
def test_a_pass_that_runs_out_of_memory_is_retried_in_smaller_passes(train, monkeypatch):
    """Running out of GPU memory while a pass of several batches is augmented (outside the
    trainer's step, whose recovery splits micro-batches) halves the passes and goes on: the
    batches are those the loader gives without failing, and nothing is drawn twice."""
    g = torch.Generator().manual_seed(1)
    bs = 4  # three draws of parameters (PARAM_BATCHES batches each) and a part batch
    images = torch.randint(0, 256, (3 * fastdata.PARAM_BATCHES * bs + 5, 3, 10, 10),
                           dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 6, (len(images),), generator=g)

    def loader(pass_batches):
        return CachedLoader(images, labels, batch_size=bs, train=train,
                            device=torch.device("cpu"), seed=5, channels_last=False,
                            pass_batches=pass_batches)

    expected = list(loader(1))
    failing, calls = loader(8), []
    name = "augment_with" if train else "normalise"
    real = getattr(fastdata, name)
    first_of_draw_2 = fastdata.PARAM_BATCHES // 8 + 1  # the pass right after a new draw

    def flaky(x, *rest):
        calls.append(len(x))
        # two failures in a row there: passes of 8 batches, then of 4
        if len(x) > 2 * bs and len(calls) in (first_of_draw_2, first_of_draw_2 + 1):
            raise TORCH_OOM("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(x, *rest)

    monkeypatch.setattr(fastdata, name, flaky)
    got = list(failing)
    assert failing.pass_batches == 2
    assert len(got) == len(expected)
    for (xa, ya), (xb, yb) in zip(expected, got):
        assert torch.equal(ya, yb) and torch.allclose(xa, xb, atol=1e-5)
    assert calls[:first_of_draw_2 + 2] == [8 * bs] * first_of_draw_2 + [4 * bs, 2 * bs]
    assert len(list(failing)) == len(expected)  # the next epoch keeps the smaller passes
    assert max(calls[first_of_draw_2 + 1:]) <= 2 * bs


def test_a_pass_never_straddles_two_draws_whatever_size_is_asked():
    images = torch.zeros((4, 3, 8, 8), dtype=torch.uint8)
    for asked, used in ((1, 1), (3, 2), (6, 4), (8, 8), (1000, fastdata.PARAM_BATCHES)):
        loader = CachedLoader(images, torch.zeros(4, dtype=torch.int64), batch_size=2,
                              train=True, device=torch.device("cpu"), seed=0,
                              channels_last=False, pass_batches=asked)
        assert loader.pass_batches == used


def test_a_single_batch_that_runs_out_of_memory_is_one_line_naming_the_option(monkeypatch):
    images = torch.zeros((12, 3, 8, 8), dtype=torch.uint8)
    loader = CachedLoader(images, torch.zeros(12, dtype=torch.int64), batch_size=4, train=True,
                          device=torch.device("cpu"), seed=0, channels_last=False)

    def fail(*args):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(fastdata, "augment_with", fail)
    with pytest.raises(OutOfMemoryError, match="one batch of 4 images at 8 px.*--batch-size"):
        list(loader)
    monkeypatch.setattr(fastdata, "augment_with", lambda *a: 1 / 0)  # not memory: as it is
    with pytest.raises(ZeroDivisionError):
        list(loader)


def test_the_cache_goes_on_the_gpu_only_beside_a_step_planned_to_the_memory_margin():
    """The memory probe plans a training step up to MEMORY_MARGIN of the GPU; the decoded
    images go there only within what that leaves (less one augmentation pass), and within
    CACHE_GPU_FRACTION of the free memory. A T4 (15 GB) holds Intel's 150 px images (1.2 GB)."""
    gib = 2**30
    t4 = 15 * gib
    assert fastdata.cache_on_gpu(int(1.2 * gib), free=14 * gib, total=t4)
    assert not fastdata.cache_on_gpu(int(2.8 * gib), free=14 * gib, total=t4)  # beside the step
    assert not fastdata.cache_on_gpu(int(1.2 * gib), free=4 * gib, total=t4)   # 25% of free
    assert fastdata.cache_on_gpu(int(20 * gib), free=130 * gib, total=140 * gib)
    # one augmentation pass is at least one batch: large batches of large images leave less
    batch = fastdata.cache_bytes(512, 224)  # 77 MB of uint8, 308 MB as float32
    assert fastdata.cache_on_gpu(int(1.6 * gib), free=14 * gib, total=t4)
    assert not fastdata.cache_on_gpu(int(1.6 * gib), free=14 * gib, total=t4, batch_bytes=batch)


def test_images_rewritten_under_the_same_names_are_decoded_again(folder):
    """A notebook re-run on fixed or other images under the same names: the memo of decoded
    images is keyed by the files' sizes and times, not their paths alone."""
    from PIL import Image
    index = index_dataset(folder)
    before, _ = fastdata.decoded_images(index.test, 16)
    path = index.test[0][0]
    Image.new("RGB", (40, 40)).save(path)  # black, and another size of file
    after, _ = fastdata.decoded_images(index_dataset(folder).test, 16)
    assert before[0].float().mean() > 0 and after[0].float().mean() == 0
    assert after.shape[1] == 3 and after.is_contiguous()  # NCHW, decoded in place


def test_a_split_list_changed_in_place_is_decoded_in_its_new_order(folder):
    """A library caller who shuffled index.train in place got the images of the old order
    with the labels of the new: 38 of 54 training images carried another class's label."""
    import random
    index = index_dataset(folder, seed=1)
    before, _ = fastdata.decoded_images(index.train, 16)
    order = list(range(len(index.train)))
    random.Random(0).shuffle(order)
    index.train[:] = [index.train[i] for i in order]
    after, _ = fastdata.decoded_images(index.train, 16)
    assert torch.equal(after, before[order])


def test_under_torchrun_the_ranks_cache_or_stream_together_and_count_every_ranks_cache(
        folder, monkeypatch):
    """Two processes on the machine: the caches both already hold count as free to take again
    (the second call at a size was refused for the other rank's copy), and a rank over its
    budget makes every rank stream (else they would train on different pipelines)."""
    index = index_dataset(folder)
    monkeypatch.setattr(fastdata.distributed, "world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    others_over = [False]
    monkeypatch.setattr(fastdata.distributed, "any_rank",
                        lambda flags, device: [flags[0] or others_over[0]])
    needed, _, _ = fastdata._budget(index, 32)
    machine = needed / fastdata.CACHE_RAM_FRACTION + 1  # just fits, with nothing held

    def held():
        return sum(images.numel() for images, _ in fastdata._MEMO.values())
    # what both processes' caches leave free
    monkeypatch.setattr(fastdata, "available_ram", lambda: machine - 2 * held())
    assert fastdata.cached_loaders(index, _config(image_size=32)) is not None
    assert held() > 0
    assert fastdata.cached_loaders(index, _config(image_size=32)) is not None  # held, kept
    others_over[0] = True
    assert fastdata.cached_loaders(index, _config(image_size=32)) is None


def test_the_cache_budget_counts_every_process_and_a_containers_limit(folder, monkeypatch,
                                                                        tmp_path):
    """Under torchrun each process on the machine holds a whole cache; a container's memory
    limit bounds what is available where the machine shows more."""
    index = index_dataset(folder)
    alone, _, _ = fastdata._budget(index, 32)
    monkeypatch.setattr(fastdata.distributed, "world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four, _, _ = fastdata._budget(index, 32)
    means = 4 * fastdata.cache_bytes(min(fastdata.MEANS_CHUNK, len(index.train)), 32)
    assert four - means == 4 * (alone - means)
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(str(300 * 2**20)), usage.write_text(str(100 * 2**20))
    stat = tmp_path / "memory.stat"
    monkeypatch.setattr(fastdata, "CGROUP_MEMORY_FILES", ((str(limit), str(usage), str(stat)),))
    assert fastdata.available_ram() == min(200 * 2**20, fastdata.psutil.virtual_memory().available)
    # the page cache the kernel reclaims first (files read once) is not taken
    stat.write_text(f"anon {70 * 2**20}\nfile {30 * 2**20}\ninactive_file {25 * 2**20}\n")
    assert fastdata.available_ram() == min(225 * 2**20, fastdata.psutil.virtual_memory().available)
    stat.write_text(f"inactive_file {5 * 2**20}\ntotal_inactive_file {25 * 2**20}\n")  # v1's
    assert fastdata.available_ram() == min(225 * 2**20, fastdata.psutil.virtual_memory().available)
    # the memory limit a CPU run's diagnosis measures its peak against
    assert fastdata.total_ram() == min(300 * 2**20, fastdata.psutil.virtual_memory().total)
    limit.write_text("max")
    assert fastdata.available_ram() == fastdata.psutil.virtual_memory().available
    assert fastdata.total_ram() == fastdata.psutil.virtual_memory().total
