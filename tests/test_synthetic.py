"""The synthetic Intel stand-in: layout, determinism, incremental caching, atomic writes, and
that the class cannot be read off the mean colour."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules import synthetic
from modules.synthetic import CLASSES, draw_scene, ensure_synthetic


def _files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def _mtimes(root):
    return {p: (root / p).stat().st_mtime_ns for p in _files(root)}


def test_layout_size_and_mode(tmp_path):
    assert ensure_synthetic(tmp_path, 2, 1) == tmp_path
    expected = sorted(
        [f"seg_train/seg_train/{c}/{i}.jpg" for c in CLASSES for i in range(2)]
        + [f"seg_test/seg_test/{c}/0.jpg" for c in CLASSES])
    assert [str(p) for p in _files(tmp_path)] == expected  # and no temp files left behind
    for rel in expected:
        with Image.open(tmp_path / rel) as img:
            assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (150, 150))


def test_same_seed_same_bytes_across_roots(tmp_path):
    a, b, c = (ensure_synthetic(tmp_path / name, 2, 1, seed=s)
               for name, s in (("a", 3), ("b", 3), ("c", 4)))
    for rel in _files(a):
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    rel = _files(a)[0]
    assert (a / rel).read_bytes() != (c / rel).read_bytes()  # the seed matters
    # Train and test images with the same index differ (the split is part of the seed).
    assert (a / "seg_train/seg_train/sea/0.jpg").read_bytes() != \
        (a / "seg_test/seg_test/sea/0.jpg").read_bytes()


def test_draw_scene_is_a_pure_function_of_the_rng():
    first = np.asarray(draw_scene(4, np.random.default_rng(7)))
    again = np.asarray(draw_scene(4, np.random.default_rng(7)))
    assert first.shape == (150, 150, 3) and first.dtype == np.uint8
    assert np.array_equal(first, again)
    assert not np.array_equal(first, np.asarray(draw_scene(4, np.random.default_rng(8))))


def test_larger_request_extends_cache_without_rewriting(tmp_path):
    small = ensure_synthetic(tmp_path / "small", 1, 1)
    before = set(_files(small))
    old = 1_000_000_000 * 10**9  # an mtime (2001) no fresh write can have
    for rel in before:
        os.utime(small / rel, ns=(old, old))
    ensure_synthetic(small, 3, 2)
    after = _mtimes(small)
    assert len(after) == 6 * (3 + 2)
    assert {rel for rel, t in after.items() if t == old} == before  # untouched, not rewritten
    # Extending gives exactly what a fresh full request gives.
    full = ensure_synthetic(tmp_path / "full", 3, 2)
    assert all((small / rel).read_bytes() == (full / rel).read_bytes() for rel in _files(full))
    # A repeated (or smaller) request writes nothing.
    ensure_synthetic(small, 3, 2)
    ensure_synthetic(small, 1, 0)
    assert _mtimes(small) == after


def test_interrupted_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def broken_save(self, fp, *args, **kwargs):
        fp.write(b"\xff\xd8 half a jpeg")
        raise KeyboardInterrupt

    monkeypatch.setattr(Image.Image, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        ensure_synthetic(tmp_path, 1, 0)
    assert _files(tmp_path) == []


def test_rejects_bad_counts(tmp_path):
    with pytest.raises(ValueError):
        ensure_synthetic(tmp_path, -1, 0)


def test_class_not_predictable_from_mean_colour():
    """Nearest centroid on per-channel means (and stds) stays far below a CNN's ~90 %."""
    def features(split, n=30):
        x, y = [], []
        for c in range(len(CLASSES)):
            for i in range(n):
                rng = np.random.default_rng([99, split, c, i])
                img = np.asarray(draw_scene(c, rng), np.float32)
                x.append(np.concatenate([img.mean((0, 1)), img.std((0, 1))]))
                y.append(c)
        return np.array(x), np.array(y)

    (x_train, y_train), (x_test, y_test) = features(0), features(1)
    mu, sd = x_train.mean(0), x_train.std(0)
    x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
    for cols in (slice(0, 3), slice(0, 6)):  # means only; means and stds
        centroids = np.stack([x_train[y_train == c, cols].mean(0) for c in range(len(CLASSES))])
        dist = ((x_test[:, None, cols] - centroids[None]) ** 2).sum(-1)
        accuracy = (dist.argmin(1) == y_test).mean()
        assert accuracy < 0.45, (cols, accuracy)  # chance is 1/6; measured about 0.2


def test_families_pair_classes_with_distinct_textures():
    # Each family holds exactly two classes, and every class has its own texture.
    families = [synthetic._FAMILY[c] for c in CLASSES]
    assert sorted(families.count(f) for f in set(families)) == [2, 2, 2]
    assert len({synthetic._TEXTURES[c] for c in CLASSES}) == len(CLASSES)


def test_each_preset_sees_its_own_images_in_a_shared_folder(tmp_path, monkeypatch):
    """--quick and the full preset generate into the same folder; a full run made before a
    quick one (or after) must not change the other's images, splits or fingerprint."""
    import pipeline
    import scenario
    monkeypatch.setattr(scenario, "SYNTHETIC_PER_CLASS", (6, 2))
    monkeypatch.setattr(scenario, "QUICK_SYNTHETIC_PER_CLASS", (4, 3))
    monkeypatch.setattr(scenario, "QUICK_PER_CLASS", {"train": 3, "val": 1, "test": 3})

    def load(out, *flags):
        index = scenario.load_data(pipeline.parse_args(["--output-dir", str(out), *flags]), out)
        return [[(str(Path(p).relative_to(out)), label) for p, label in split]
                for split in (index.train, index.val, index.test)]

    alone = {flags: load(tmp_path / f"alone{i}", *flags)
             for i, flags in enumerate([("--quick",), ()])}
    both = tmp_path / "both"
    assert load(both) == alone[()]
    assert load(both, "--quick") == alone[("--quick",)]  # the full run's 6 + 2 are there too
    assert load(both) == alone[()]  # and the quick run's 3 test images per class
    assert len(alone[()][2]) == 2 * len(CLASSES)


def test_cache_of_another_generator_is_not_extended(tmp_path, monkeypatch):
    """A set drawn by another generator (another version, or numpy/Pillow computing it
    otherwise on another machine) is used as it is, but never topped up with this one's
    images: the set would be two sets under one name."""
    from modules.config import UserError
    root = ensure_synthetic(tmp_path / "s", 2, 1)
    before = {rel: (root / rel).read_bytes() for rel in _files(root)}
    monkeypatch.setattr(synthetic, "JPEG_QUALITY", synthetic.JPEG_QUALITY - 5)
    assert ensure_synthetic(root, 2, 1) == root  # nothing to add: used as it is
    with pytest.raises(UserError, match="generated otherwise"):
        ensure_synthetic(root, 3, 1)
    assert {rel: (root / rel).read_bytes() for rel in _files(root)} == before  # nothing added
    monkeypatch.undo()
    ensure_synthetic(root, 3, 1)  # this generator's own set is extended
    assert len(_files(root)) == len(before) + len(CLASSES)
