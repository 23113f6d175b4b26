"""Offline real image sets, written out as class folders of PNGs for the benchmarks and tests.

Nothing here downloads: each set ships inside a PyPI package (scikit-learn, animal-mnist).
"""
from __future__ import annotations

import gzip
import pickle
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image

ANIMAL_CLASSES = ("bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra")


def _write(root: Path, images, labels, names, per_class, size, resample) -> Path:
    counts: dict[int, int] = {}
    for image, label in zip(images, labels):
        label = int(label)
        if per_class is not None and counts.get(label, 0) >= per_class:
            continue
        counts[label] = counts.get(label, 0) + 1
        path = root / names[label] / f"{counts[label]}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).resize((size, size), resample).save(path)
    return root


def export_digits(root, per_class=None):
    """scikit-learn's handwritten digits (UCI, 1797 images, 8x8 grey): 32x32 grayscale PNGs, classes '0'..'9'."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255 / 16)).astype(np.uint8)  # the set stores 0..16
    names = [str(c) for c in range(10)]
    return _write(Path(root), pixels, digits.target, names, per_class, 32, Image.NEAREST)


def export_animals(root, per_class=None, size=32):
    """Animal-MNIST (pip package animal-mnist, MIT): 10 animal classes of 28x28 grey silhouettes,
    1000 a class; exact duplicate images (284, mostly birds) are dropped, leaving 9716."""
    try:
        folder = resources.files("animal_mnist") / "data" / "Animal_MNIST"
    except ModuleNotFoundError:
        raise RuntimeError("Animal-MNIST needs its package: pip install --no-deps animal-mnist==0.4") from None
    # The package's own loader imports TensorFlow; the data are two gzipped pickles of numpy arrays.
    with gzip.open(folder / "animal_data_version_3.gz", "rb") as f:
        images = np.asarray(pickle.load(f), dtype=np.uint8)  # (10000, 28, 28), sorted by class
    with gzip.open(folder / "animal_label_version_3.gz", "rb") as f:
        labels = np.asarray(pickle.load(f))
    _, first = np.unique(images.reshape(len(images), -1), axis=0, return_index=True)
    keep = np.sort(first)
    return _write(Path(root), images[keep], labels[keep], ANIMAL_CLASSES, per_class, size, Image.BILINEAR)


REAL_SETS = {"digits": export_digits, "animals": export_animals}
