"""Offline stand-in for Intel Image Classification: procedurally drawn 150x150 scenes in six
classes, where class pairs share layout and palette and differ only in a fine texture."""
from __future__ import annotations

import io
import os
import secrets
from pathlib import Path

import numpy as np
from PIL import Image

from modules.config import UserError

CLASSES = ("buildings", "forest", "glacier", "mountain", "sea", "street")
SIZE = 150
JPEG_QUALITY = 90
_SPLITS = {"train": ("seg_train", 0), "test": ("seg_test", 1)}  # folder, seed component

# Families share layout and palette; the two members differ only in a texture whose period
# (about 3-4 px) is resolvable at ~128+ px input but averaged away at ~48-64 px.
_FAMILY = {"buildings": "urban", "street": "urban", "forest": "terrain",
           "mountain": "terrain", "glacier": "cold", "sea": "cold"}
_YY, _XX = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)


# ----------------------------------------------------------------------------- cache on disk

def ensure_synthetic(root: str | Path, n_train_per_class: int, n_test_per_class: int,
                     seed: int = 0) -> Path:
    """Make sure root holds at least these many images per class in Intel's layout
    root/seg_train/seg_train/<class>/<i>.jpg and root/seg_test/seg_test/<class>/<i>.jpg (150x150 RGB JPEG).
    Generates only missing files (image i of class c of split s is a pure function of (seed, s, c, i)),
    so a larger request extends a smaller cache and a repeated request does nothing. A cache this
    generator would not have drawn (another version's, or made where numpy or Pillow compute it
    otherwise) is not extended: UserError. Returns root."""
    root = Path(root)
    missing = []
    for split, count in (("train", n_train_per_class), ("test", n_test_per_class)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"images per class must be an integer >= 0, but got {count!r}")
        folder_name, split_id = _SPLITS[split]
        for c, name in enumerate(CLASSES):
            folder = root / folder_name / folder_name / name
            missing += [(folder / f"{i}.jpg", split_id, c, i) for i in range(count)
                        if not (folder / f"{i}.jpg").exists()]
    if missing:
        _check_same_generator(root, seed)  # else two generators' images under one name
    for path, split_id, c, i in missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # another process may have written it meanwhile
            _write_atomically(draw_scene(c, np.random.default_rng([seed, split_id, c, i])), path)
    return root


def _check_same_generator(root: Path, seed: int) -> None:
    """Refuses to extend a cache whose first image of each class and split is not what this
    generator draws now (a changed draw_scene, numpy's random streams or its SIMD maths, or
    Pillow's JPEG encoder), in one line: the new images would be mixed with the old ones."""
    for folder_name, split_id in _SPLITS.values():
        for c, name in enumerate(CLASSES):
            path = root / folder_name / folder_name / name / "0.jpg"
            if not path.is_file():
                continue
            buffer = io.BytesIO()
            draw_scene(c, np.random.default_rng([seed, split_id, c, 0])).save(
                buffer, format="JPEG", quality=JPEG_QUALITY)
            if path.read_bytes() != buffer.getvalue():
                raise UserError(
                    f"the synthetic set in {str(root)!r} was generated otherwise than this "
                    f"version draws it ({path.relative_to(root).as_posix()} differs: another "
                    "version of the generator, or of numpy or Pillow, or a CPU numpy computes "
                    "with other instructions), and it lacks images this run needs: adding them "
                    "would mix two sets under one name. Move that folder away to generate the "
                    "set anew, or run with the images it holds (--quick, if it was made by one).")


def _write_atomically(img: Image.Image, path: Path) -> None:
    # A hidden temp name in the same folder: dataset scans skip it, and os.replace is atomic,
    # so an interrupted run never leaves a half-written .jpg behind. Unique per writer, so
    # concurrent runs filling the same cache cannot clobber each other's temp files; plain
    # open() (not mkstemp) keeps the umask's permissions, so a shared cache stays readable.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            img.save(f, format="JPEG", quality=JPEG_QUALITY)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- drawing

def draw_scene(class_index: int, rng: np.random.Generator) -> Image.Image:
    """One 150x150 RGB scene of class CLASSES[class_index], fully determined by rng."""
    name = CLASSES[class_index]
    img = _sky(rng)
    regions = _LAYOUTS[_FAMILY[name]](img, rng)
    for mask in regions:  # texture only some surfaces, at modest contrast
        if rng.random() < 0.75:
            img += (rng.uniform(10, 24) * _TEXTURES[name](rng))[..., None] * mask[..., None]
    _distractors(img, rng)
    # Global brightness/contrast jitter and sensor noise keep brightness uninformative.
    img = (img - 128) * rng.uniform(0.7, 1.2) + 128 + rng.uniform(-35, 35)
    img += rng.normal(0, rng.uniform(3, 9), img.shape).astype(np.float32)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def _colour(rng: np.random.Generator) -> np.ndarray:
    """Any colour: every class draws from the same distribution, so hue carries no label."""
    return rng.uniform(20, 235, 3).astype(np.float32)


def _sky(rng: np.random.Generator) -> np.ndarray:
    top, bottom = _colour(rng), _colour(rng)
    t = (_YY / SIZE)[..., None]
    return top * (1 - t) + bottom * t


def _fill(img: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> None:
    """Paint mask with a random colour shaded by a random linear gradient."""
    h = SIZE / 2
    shade = 1 + rng.uniform(-0.3, 0.3) * (_YY - h) / h + rng.uniform(-0.2, 0.2) * (_XX - h) / h
    img[mask] = (_colour(rng) * shade[..., None])[mask]


def _urban(img: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Blocks of random widths and heights standing on a ground band; blocks take texture."""
    ground = rng.uniform(105, 140)
    regions, x = [], rng.uniform(-20, 0)
    while x < SIZE:
        w, top = rng.uniform(18, 50), rng.uniform(15, 90)
        mask = (_XX >= x) & (_XX < x + w) & (_YY >= top) & (_YY < ground)
        _fill(img, mask, rng)
        regions.append(mask)
        x += w + rng.uniform(0, 10)
    _fill(img, _YY >= ground, rng)
    return regions


def _terrain(img: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """One to three jagged ridges (random-walk outlines); each ridge body takes texture."""
    regions = []
    for _ in range(rng.integers(1, 4)):
        walk = np.cumsum(rng.normal(0, rng.uniform(1.5, 4), SIZE))
        peak = np.abs(_XX[0] - rng.uniform(0, SIZE))  # distance from the summit
        ridge = rng.uniform(30, 100) + walk - walk.mean() + rng.uniform(0, 0.8) * peak
        mask = _YY >= ridge[None, :].astype(np.float32)
        _fill(img, mask, rng)
        regions.append(mask)
    return regions


def _cold(img: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Flat horizon with a smooth lower plane and a few rounded floes; both take texture."""
    horizon = rng.uniform(35, 100)
    plane = _YY >= horizon
    _fill(img, plane, rng)
    regions = [plane]
    for _ in range(rng.integers(0, 3)):
        cx, cy = rng.uniform(0, SIZE), rng.uniform(horizon, SIZE)
        rx, ry = rng.uniform(15, 50), rng.uniform(5, 18)
        mask = ((_XX - cx) / rx) ** 2 + ((_YY - cy) / ry) ** 2 <= 1
        _fill(img, mask, rng)
        regions.append(mask)
    return regions


_LAYOUTS = {"urban": _urban, "terrain": _terrain, "cold": _cold}


# Textures: zero-mean maps of about unit standard deviation, so that neither the mean colour
# nor the contrast of a region tells the two classes of a family apart.

def _period(rng: np.random.Generator) -> float:
    return rng.uniform(3.0, 3.6)


def _square_wave(u: np.ndarray, period: float, duty: float) -> np.ndarray:
    on = (u % period) < duty * period
    return on.astype(np.float32) - duty


def _windows(rng):  # buildings: a dense grid of small windows
    p, q = _period(rng), _period(rng)
    col = (_XX + rng.uniform(0, p)) % p < p / 2
    row = (_YY + rng.uniform(0, q)) % q < q / 2
    return 2 * ((col & row).astype(np.float32) - 0.25)


def _lanes(rng):  # street: thin diagonal lane stripes
    slope = rng.choice([-1.0, 1.0]) * rng.uniform(0.7, 1.4)
    return 2 * _square_wave(_XX + slope * _YY + rng.uniform(0, 10), _period(rng) * 1.2, 0.5)


def _trunks(rng):  # forest: thin vertical trunk stripes, slightly wavy
    wobble = rng.uniform(0, 1.0) * np.sin(_YY / rng.uniform(8, 20))
    return 2 * _square_wave(_XX + wobble + rng.uniform(0, 10), _period(rng), 0.5)


def _strata(rng):  # mountain: fine horizontal rock strata, slightly wavy
    wobble = rng.uniform(0, 1.0) * np.sin(_XX / rng.uniform(8, 20))
    return 2 * _square_wave(_YY + wobble + rng.uniform(0, 10), _period(rng), 0.5)


def _speckle(rng):  # glacier: ice sparkles on a staggered lattice
    # A lattice, not random dots: white-noise dots would leave low-frequency grain that
    # survives downscaling and give the class away at low resolution.
    p, q = _period(rng), _period(rng)
    y = _YY + rng.uniform(0, q)
    col = (_XX + rng.uniform(0, p) + np.floor(y / q) * p / 2) % p < p / 2
    dots = col & (y % q < q / 2)
    return 2 * (dots.astype(np.float32) - 0.25)


def _ripples(rng):  # sea: fine wavy horizontal ripples
    wave = rng.uniform(1, 2.5) * np.sin(_XX / rng.uniform(3, 8) + rng.uniform(0, 6.3))
    return np.sin(2 * np.pi * (_YY + wave) / _period(rng)).astype(np.float32) * 1.2


_TEXTURES = {"buildings": _windows, "street": _lanes, "forest": _trunks,
             "mountain": _strata, "glacier": _speckle, "sea": _ripples}


def _distractors(img: np.ndarray, rng: np.random.Generator) -> None:
    """Random discs and bars of any colour, in every class, so no single blob is a cue."""
    for _ in range(rng.integers(1, 5)):
        cx, cy, r = rng.uniform(0, SIZE), rng.uniform(0, SIZE), rng.uniform(3, 14)
        if rng.random() < 0.5:
            mask = (_XX - cx) ** 2 + (_YY - cy) ** 2 <= r * r
        else:
            mask = (np.abs(_XX - cx) <= r) & (np.abs(_YY - cy) <= rng.uniform(1, 4))
        img[mask] = _colour(rng)
