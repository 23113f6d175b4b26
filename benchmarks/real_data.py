"""Offline real image sets, written out as class folders of PNGs for the benchmarks and tests.

Nothing here downloads: each set ships inside a PyPI package (scikit-learn, animal-mnist,
elpv-dataset).
"""
from __future__ import annotations

import gzip
import pickle
import random
import shutil
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


def export_elpv(root, per_class=None, test_share=0.4, seed=0):
    """ELPV (pip package elpv-dataset, CC BY-NC-SA 4.0): 2,624 electroluminescence images of
    solar cells, 300x300 grey, each rated by experts as defective with probability 0, 1/3, 2/3
    or 1, from monocrystalline or polycrystalline modules. Unlike the other sets its images are
    larger than every input size the tuners compare, so the size chosen decides what detail
    (a crack is a few pixels wide) the model sees.

    Two classes, copied at their own size into train/ and test/: 'defective' (2/3 or 1: 821)
    and 'functional' (0), drawn to the same count of each cell type as the defective ones, so
    that the type (the most visible difference) tells nothing; the uncertain 1/3 is left out.
    test_share of each class and type is the test split: 658 images at 0.4, where the pipeline's
    20% of a folder of class folders would leave 328. Even 658 cannot tell 3 points at ELPV's
    70-72%: the standard error of a difference of two accuracies there is 2.4-2.5 points (the
    benchmark's test-set line says so); a larger share would leave too few to train on."""
    try:
        data = resources.files("elpv_dataset") / "data"
    except ModuleNotFoundError:
        raise RuntimeError("ELPV needs its package: pip install --no-deps elpv-dataset==1.0.0.post1") from None
    groups: dict[tuple[str, str], list[str]] = {}
    with (data / "labels.csv").open() as f:  # columns: path, probability, type (space-aligned)
        for path, probability, kind in (line.split() for line in f if line.strip()):
            probability = float(probability)
            if 0 < probability < 0.5:
                continue
            groups.setdefault(("defective" if probability > 0.5 else "functional", kind), []).append(path)
    rng = random.Random(seed)
    root = Path(root)
    all_defective = sum(len(paths) for (label, _), paths in groups.items() if label == "defective")
    for kind in sorted({kind for _, kind in groups}):
        defective = sorted(groups.get(("defective", kind), []))
        functional = sorted(groups.get(("functional", kind), []))
        n = min(len(defective), len(functional))
        if per_class is not None:  # the same share of each type as in the whole set
            n = min(n, round(per_class * len(defective) / all_defective))
        for label, paths in (("defective", defective), ("functional", functional)):
            chosen = rng.sample(paths, n)
            n_test = round(n * test_share)
            for i, path in enumerate(chosen):
                target = root / ("test" if i < n_test else "train") / label / f"{kind}-{Path(path).name}"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(data / path, target)
    return root


REAL_SETS = {"digits": export_digits, "animals": export_animals, "elpv": export_elpv}
