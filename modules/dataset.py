"""Data sources (Intel via kagglehub, any image folder, the synthetic set), image decoding,
transforms and DataLoaders."""
from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import random
import re
import time
import unicodedata
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, features
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from modules import distributed
from modules.config import IMAGENET_MEAN, IMAGENET_STD, TrainConfig, UserError, first_line
from modules.device import usable_cpus
from modules.files import IO_FAILED, io_failed

# Images between PIL's limit and twice it are used (beyond, they are skipped as bombs); its
# warning for each one says nothing the user can act on.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

log = logging.getLogger(__name__)

# Kaggle's dataset, pinned to a version so a cached copy resolves without the network.
INTEL_HANDLE = "puneet6060/intel-image-classification/versions/2"
IMAGE_EXTS = {".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm",
              ".pgm", ".pbm", ".jfif"} | ({".avif"} if "avif" in features.modules and
                                         features.check_module("avif") else set())
OUTSIDE_CLASSES = "images outside a class folder"
# The split's seed where a library caller gives none: the pipeline's (--seed), so that the same
# folder splits alike, and a pipeline model's test images are the library's
DEFAULT_SEED = TrainConfig.seed
VAL_FRACTION = 0.1  # share of each train class held out for validation when no val/ split exists
# ... raised for a small training set, up to MAX_VAL_FRACTION, so that validation holds about
# MIN_VAL_IMAGES: fewer cannot separate candidates (500 images: +-2.2 points at 50% accuracy).
MIN_VAL_IMAGES, MAX_VAL_FRACTION = 500, 0.25


# EXIF orientation (tag 0x0112) -> the transpose that shows the photo as the camera held it.
ORIENTATION = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
               4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
               6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
               8: Image.Transpose.ROTATE_90}


def upright(img: Image.Image) -> Image.Image:
    """The image as the camera held it: phones store a portrait photo's pixels sideways with
    an EXIF orientation tag, which a plain decode ignores. Only the tag is read:
    ImageOps.exif_transpose also rewrites the EXIF block, and raises on a malformed one
    (TypeError, struct.error ...) in photos that decode well. A block that cannot be read at
    all leaves the pixels as stored."""
    try:
        method = ORIENTATION.get(img.getexif().get(0x0112))
    except Exception:  # PIL raises assorted errors for a malformed block
        return img
    return img if method is None else img.transpose(method)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode (L, P, RGBA, CMYK, I;16, F, 1 ...) as 8-bit RGB; transparency over white,
    whether an alpha channel or one colour keyed transparent (PNG's tRNS in an L, RGB or 1
    image: left as stored, the same logo would train on white as RGBA and on black as RGB)."""
    if img.mode in ("1", "L", "P", "RGB") and _keyed_8bit(img):
        img = img.convert("RGBA")
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        return _to_8bit(img).convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _keyed_8bit(img: Image.Image) -> bool:
    """Whether `img` has a transparent colour Pillow can apply: a palette's, or an 8-bit
    key. A 16-bit PNG opens as 8-bit RGB but keeps its 16-bit key, which Pillow would match
    by its low byte, whitening other pixels than the transparent ones: left as stored."""
    key = img.info.get("transparency")
    if key is None:
        return False
    if img.mode == "P":
        return True
    values = key if isinstance(key, tuple) else (key,)
    return all(isinstance(v, int) and 0 <= v <= 255 for v in values)


STRETCH_CHUNK_PX = 2**20  # pixels converted to float64 at a time (8 MB)


def _to_8bit(img: Image.Image) -> Image.Image:
    """A 16- or 32-bit image as 8-bit L. 16-bit values (I;16, or I within 0..65535, as older
    Pillows open 16-bit PNGs) scale by their bit depth's range, as 8 bits of the same scene
    would read: 16 bits, or 12 (values up to 4095: a 12-bit sensor's, stored in 16) or 8
    (values up to 255: 8-bit data stored wide), which the full 16-bit range would leave at
    1/16 of their brightness or black. Other I and F images have their min..max stretched to
    0..255, a flat one clipped to its level. Done in bands of rows: the whole image as float64
    costs 8 bytes a pixel, several times over in temporaries, before any resize could shrink
    it."""
    width, height = img.size
    rows = max(1, STRETCH_CHUNK_PX // max(1, width))
    bands = [(top, min(height, top + rows)) for top in range(0, height, rows)]

    def band(top: int, bottom: int) -> np.ndarray:
        return np.asarray(img.crop((0, top, width, bottom)), dtype=np.float64)

    extremes = np.array([(values.min(), values.max())
                         for values in (band(top, bottom) for top, bottom in bands)])
    lo, hi = float(extremes[:, 0].min()), float(extremes[:, 1].max())  # a NaN stays NaN
    if img.mode.startswith("I;16") or (img.mode == "I" and lo >= 0 and hi <= 65535):
        top = 255.0 if hi <= 255 else 4095.0 if hi <= 4095 else 65535.0
        lo, scale, rounding = 0.0, 255.0 / top, 0.5  # 155 * 257 scales to 154.99999999999997
    elif hi > lo:
        scale, rounding = 255.0 / (hi - lo), 0.0
    else:
        level = np.clip(np.nan_to_num(lo), 0, 255)
        return Image.fromarray(np.full((height, width), level, dtype=np.uint8))
    out = np.empty((height, width), dtype=np.uint8)
    for top, bottom in bands:
        values = band(top, bottom)
        values -= lo
        values *= scale
        values += rounding
        out[top:bottom] = values.astype(np.uint8)
    return Image.fromarray(out)


def load_rgb(path, draft: int | None = None) -> Image.Image:
    """Decode one image file fully into upright RGB (raises on truncated or undecodable
    files). draft: a JPEG decodes at the smallest DCT scale that is at least this size."""
    with Image.open(path) as img:
        if draft is not None:
            img.draft("RGB", (draft, draft))
        img.load()
        return to_rgb(upright(img))


class SquareRandomResizedCrop(T.RandomResizedCrop):
    """RandomResizedCrop with its area and aspect ratio drawn in the image as squashed to a
    square, as eval_transform, predict and the decoded cache see every image: on a 16:9
    photo, drawn in its own pixels, objects would train 1.33x squeezed at most where they
    are tested 1.78x. A square image is cropped exactly as RandomResizedCrop crops it."""

    SIDE = 4096  # the square the crop is drawn in, then scaled to the image

    def forward(self, img):
        width, height = TF.get_image_size(img)
        if width == height:
            return super().forward(img)
        square = torch.empty(1, 1, 1).expand(1, self.SIDE, self.SIDE)  # only its shape is read
        top, left, h, w = self.get_params(square, self.scale, self.ratio)
        sy, sx = height / self.SIDE, width / self.SIDE
        return TF.resized_crop(img, round(top * sy), round(left * sx), max(1, round(h * sy)),
                               max(1, round(w * sx)), self.size, self.interpolation,
                               antialias=self.antialias)


def train_transform(image_size: int, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> T.Compose:
    """The baseline's per-sample PIL augmentation: random resized crop, flip, mild colour jitter."""
    return T.Compose([
        SquareRandomResizedCrop(image_size, scale=(0.6, 1.0), antialias=True),
        T.RandomHorizontalFlip(),
        T.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


def eval_transform(image_size: int, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> T.Compose:
    """Deterministic resize to image_size x image_size and normalisation."""
    return T.Compose([
        T.Resize((image_size, image_size), antialias=True),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


Sample = tuple[str, int]  # (path, class index)


IMBALANCED = 3  # the largest training class this many times the smallest: said


def _digest_groups(groups: list[list[tuple[str, int]]], name: Callable[[str], str]) -> str:
    """A digest of (image, label) lists, each image named by `name`."""
    digest = hashlib.sha1()
    for group in groups:
        for path, label in group:
            # fsencode: a file name that is not UTF-8 (zips made on Windows) hashes too
            digest.update(os.fsencode(f"{name(path)}\t{label}\n"))
        digest.update(b"\0")
    return digest.hexdigest()


@dataclass
class DatasetIndex:
    """The usable images of a dataset, split three ways, and what had to be skipped."""

    name: str                       # "intel", "synthetic" or the folder's name
    root: Path
    layout: str                     # "intel", "train/test" or "class folders"
    classes: list[str]
    train: list[Sample]
    val: list[Sample]
    test: list[Sample]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    # files not read, by what they are: an extension (".heic") or "outside a class folder"
    ignored: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of each listed image, by path
    # (path left out, the held-out image it is a byte-identical copy of): left_out_copies
    copies: list[tuple[str, str]] = field(default_factory=list)
    read_s: float = field(default=0.0, compare=False)  # seconds listing and checking it took

    @property
    def skipped_files(self) -> int:
        return len(self.skipped)

    def n_images(self) -> int:
        return len(self.train) + len(self.val) + len(self.test)

    def fingerprint(self, splits: tuple[str, ...] = ("train", "val", "test")) -> str:
        """A digest of the splits' images, named by their path inside the data folder and
        their size, and labels: what results, studies and checkpoints depend on, so that a run
        resumes only on the same data, wherever the folder is (a copy, another machine's
        download, a relative --data-dir), and not on images rewritten under the same names (a
        resized set)."""
        return self._digest(splits, self._inside)

    def images_fingerprint(self) -> str:
        """fingerprint() of the images however they are split: another --seed holds out other
        validation images of a folder without a val/ split (and other test images of one
        without test/)."""
        return _digest_groups([sorted(self.train + self.val + self.test)], self._inside)

    def _inside(self, path: str) -> str:
        """An image's name in a fingerprint: below the root as listed (no relpath needed), and
        its size."""
        prefix = os.path.join(self.root, "")
        rel = path[len(prefix):] if path.startswith(prefix) else \
            os.path.relpath(path, os.path.abspath(self.root))
        size = self.sizes.get(path)
        return rel.replace(os.sep, "/") + ("" if size is None else f"\t{size}")

    def same_data(self, recorded: str | None,
                  splits: tuple[str, ...] = ("train", "val", "test")) -> bool:
        """Whether a recorded fingerprint is this data's: as fingerprint() makes it, or as
        versions before it made it, from the paths as listed (this folder, where it is now)."""
        return recorded is not None and recorded in (self.fingerprint(splits),
                                                     self._digest(splits, str))

    def _digest(self, splits: tuple[str, ...], name: Callable[[str], str]) -> str:
        return _digest_groups([getattr(self, split) for split in splits], name)

    def skipped_lines(self) -> list[str]:
        """Each skipped file, by its path inside the data folder (a name that is not UTF-8
        with escapes, as class_name writes it), and why."""
        return [printable(f"{os.path.relpath(p, self.root)}\t{reason}")
                for p, reason in self.skipped]

    def copy_lines(self) -> list[str]:
        """Each copy left out and the held-out image it copies, by their paths inside the
        data folder."""
        return [printable(f"{os.path.relpath(p, self.root)}\t"
                          f"{os.path.relpath(kept, self.root)}") for p, kept in self.copies]

    def imbalance(self) -> str | None:
        """A line for training classes 3x apart or more: what the accuracy then hides."""
        counts = Counter(label for _, label in self.train)  # every class has some
        big, small = max(counts, key=counts.get), min(counts, key=counts.get)
        if counts[big] < IMBALANCED * max(1, counts[small]):
            return None
        # chance as the tuners take it (selection.chance_level): validation's largest class
        common, n = Counter(label for _, label in self.val).most_common(1)[0] \
            if self.val else (big, 0)
        return (f"imbalanced classes: {self.classes[big]!r} has {counts[big]} training images, "
                f"{self.classes[small]!r} {counts[small]}; a model answering "
                f"{self.classes[common]!r} alone scores {100 * n / max(1, len(self.val)):.1f}% "
                "on validation (the tuners count that as chance; per-class accuracy is in "
                "report.md)")

    def summary(self) -> str:
        return (f"{self.name}: {len(self.classes)} classes, {len(self.train)} train / "
                f"{len(self.val)} val / {len(self.test)} test images ({self.layout} layout)"
                + (f", {self.skipped_files} skipped" if self.skipped else "")
                + (f", {len(self.copies)} copies of held-out images left out" if self.copies
                   else "")
                + (f", {sum(self.ignored.values())} other files ignored" if self.ignored else ""))


# ----------------------------------------------------------------------------- sources

def download_intel() -> Path:
    """The Intel Image Classification folder from kagglehub's cache, downloading it once."""
    try:
        import kagglehub
    except ImportError:
        raise UserError("the Intel dataset needs the kagglehub package: pip install -r "
                        "requirements.txt (or pass --data-dir PATH / --dataset synthetic).") from None
    try:
        return Path(kagglehub.dataset_download(INTEL_HANDLE))
    except Exception as exc:
        reason = type(exc).__name__
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403) or reason in ("UnauthenticatedError", "CredentialError"):
            raise UserError(
                f"Kaggle refused the login ({f'HTTP {status}' if status else reason}): set "
                "KAGGLE_API_TOKEN to a token from kaggle.com > Settings > API > Generate New "
                "Token (in Colab as a secret), or the legacy KAGGLE_USERNAME and KAGGLE_KEY, or "
                "run kagglehub.login().") from None
        said = first_line(exc, 100)
        cause = f"{reason}{': ' + said if said and said != reason else ''}"
        # Causes the network is not: "download it once with network access" would not help.
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no room to download the Intel dataset ({cause}): free some space "
                            "in kagglehub's cache (KAGGLEHUB_CACHE, else ~/.cache/kagglehub), "
                            "or pass --data-dir PATH to a local copy.") from None
        if "kaggle.json" in said or "credentials file" in said.lower():
            raise UserError(f"Kaggle's credentials file cannot be read ({cause}): fix or "
                            "remove ~/.kaggle/kaggle.json (KAGGLE_CONFIG_DIR), or set "
                            "KAGGLE_API_TOKEN instead.") from None
        if "Invalid header value" in said:
            raise UserError("the Kaggle token holds a line break or a space: set KAGGLE_API_TOKEN "
                            "(or KAGGLE_KEY) again without one.") from None
        if reason in ("BadZipFile", "DataCorruptionError"):
            raise UserError(f"the Intel dataset arrived damaged ({cause}): run again to "
                            "download it once more.") from None
        raise UserError(f"the Intel dataset cannot be reached on Kaggle ({cause}); download "
                        "it once with network access, or pass --data-dir PATH to a local copy, "
                        "or use --dataset synthetic.") from None


MAX_NAME_CHARS = 200  # the longest file name made of it adds 45 characters, within 255


def folder_dataset_name(root: Path) -> str:
    """A data folder's name as the outputs' names use it (`<name>_model.pt`, the study's):
    safe characters, and at most MAX_NAME_CHARS, a longer one cut and told apart by a hash of
    the whole (whole, a 240-character folder name made the model file's temporary name longer
    than file systems allow, and every run failed after its first scenario)."""
    whole = root.resolve().name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", whole).strip("._") or "dataset"
    if len(name) > MAX_NAME_CHARS:
        digest = hashlib.sha1(whole.encode("utf-8", "surrogateescape")).hexdigest()[:8]
        name = f"{name[:MAX_NAME_CHARS - 9]}-{digest}"
    return name


def resolve_source(dataset: str, data_dir: str | os.PathLike | None, cache_dir: Path,
                   synthetic_per_class: tuple[int, int] = (400, 100)) -> tuple[Path, str]:
    """(root folder, dataset name) for --dataset / --data-dir; --data-dir wins."""
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        if not root.exists():
            raise UserError(f"data folder {str(root)!r} does not exist.")
        if not root.is_dir():
            raise UserError(f"--data-dir {str(root)!r} is a file, not a folder.")
        return root, folder_dataset_name(root)
    if dataset == "intel":
        return download_intel(), "intel"
    if dataset == "synthetic":
        from modules.synthetic import ensure_synthetic
        n_train, n_test = synthetic_per_class
        return ensure_synthetic(Path(cache_dir) / "synthetic", n_train, n_test), "synthetic"
    raise UserError(f"dataset must be intel or synthetic, but got {dataset!r}.")


# ----------------------------------------------------------------------------- indexing

SKIPPED_LIST = "skipped_files.txt"  # in the run's folder: every skipped file and why
COPIES_LIST = "left_out_copies.txt"  # in the run's folder: each copy left out, and of what

# The folder names each split is read from (in any case).
TRAIN_NAMES, TEST_NAMES = ("train", "training"), ("test", "testing")
VAL_NAMES = ("val", "valid", "validation")
SPLIT_NAMES = TRAIN_NAMES + TEST_NAMES + VAL_NAMES
# Words a split folder's name may add to its split's: Kaggle's training_set/, test_data/ ...
SPLIT_WORDS = ("set", "data", "dataset", "images", "imgs", "split", "folder")


def split_of(name: str) -> str | None:
    """The split a folder's name names ("train", "test" or "val"), None for a class name:
    train/, Training/, training_set/, test-data/, "Validation Set"/; not test_tube/."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    kinds = {kind for w in words for kind, names in
             (("train", TRAIN_NAMES), ("test", TEST_NAMES), ("val", VAL_NAMES)) if w in names}
    if len(kinds) != 1 or any(w not in SPLIT_NAMES + SPLIT_WORDS for w in words):
        return None
    return kinds.pop()


def _split_kind(folder: Path) -> str | None:
    """split_of for a folder beside others: a name that adds words to its split's
    (training_set/, val_images/) names a split only when it holds class folders; else it is
    a class, or an unlabelled folder beside the splits, as any other name."""
    kind = split_of(folder.name)
    if kind is None or folder.name.lower() in SPLIT_NAMES:
        return kind
    try:
        return kind if _class_dirs(_unwrapped(folder)) else None
    except OSError:
        return None


def _unwrapped(split: Path) -> Path:
    """A split folder that holds only a folder of its own name (training_set/training_set/,
    as Intel's seg_train/seg_train/ and archives unpacked into a folder of their name): the
    inner one."""
    try:
        inner = _class_dirs(split)
    except OSError:
        return split
    if len(inner) == 1 and inner[0].name.lower() == split.name.lower() and \
            not _loose_images(split):
        return inner[0]
    return split


def find_splits(root: Path) -> tuple[str, dict[str, Path]]:
    """Which layout a folder has: (layout name, {split: folder of class folders})."""
    def first_dir(*candidates: Path) -> Path | None:
        return next((c for c in candidates if c.is_dir()), None)

    intel_train = first_dir(_child(root, "seg_train", "seg_train"), _child(root, "seg_train"))
    if intel_train is not None:
        intel_test = first_dir(_child(root, "seg_test", "seg_test"), _child(root, "seg_test"))
        if intel_test is None:
            raise UserError(f"{str(root)!r} has seg_train but no seg_test folder (Intel layout).")
        return "intel", {"train": intel_train, "test": intel_test}
    folders = _class_dirs(root)
    kinds = {f: _split_kind(f) for f in folders}  # each read once: it may list the folder
    if len(folders) == 1 and kinds[folders[0]] in ("test", "val"):
        raise UserError(f"{str(root)!r} has {folders[0].name}/ but no train/ folder; add "
                        "train/<class>/ images or pass a folder of class folders to split "
                        "automatically.")

    def split_dir(kind: str, names: tuple[str, ...]) -> Path:
        named = [d for d in (_child(root, name) for name in names) if d.is_dir()] + \
            [f for f in folders if kinds[f] == kind]
        return _unwrapped(named[0]) if named else root / names[0]
    train, test, val = (split_dir("train", TRAIN_NAMES), split_dir("test", TEST_NAMES),
                        split_dir("val", VAL_NAMES))
    # train/ in any case, but a class folder named Train (beside Bus/, Car/) is not a split
    others = [f.name for f in folders if kinds[f] is None]
    lower_train = any(f.name == f.name.lower() and kinds[f] == "train" for f in folders)
    # A class named train holds images; a train/ of class folders is a split, whatever else
    # is beside it (an unlabelled pred/): taken as one class, it would train "pred vs train".
    if lower_train and not test.is_dir() and not val.is_dir() and others and \
            not _class_dirs(train):
        log.info("%r has no test/ folder: train/ is taken as a class beside %s", str(root),
                 ", ".join(others[:3]) + (" ..." if len(others) > 3 else ""))
        return "class folders", {"all": root}
    if lower_train or (train.is_dir() and test.is_dir()):
        if not test.is_dir():
            raise UserError(f"{str(root)!r} has train/ but no test/ folder; add test/<class>/ "
                            "images or pass a folder of class folders to split automatically.")
        splits = {"train": train, "test": test}
        if val.is_dir():
            splits["val"] = val
        for kind, used in (("train", train), ("test", test), ("val", val)):
            unused = [f.name for f in folders if kinds[f] == kind
                      and f not in (used, used.parent)]
            if unused and used.is_dir():  # training/ beside train/, Val/ beside val/ ...
                log.warning("%r: %s beside %s/ %s not used (each split is read from one "
                            "folder)", str(root), ", ".join(f"{u}/" for u in unused),
                            used.name, "is" if len(unused) == 1 else "are")
        if others:
            log.warning("%r: %s beside train/ and test/ %s not used (a validation split is "
                        "read from %s/)", str(root), ", ".join(f"{o}/" for o in others),
                        "is" if len(others) == 1 else "are", "/, ".join(VAL_NAMES))
        return "train/test", splits
    if folders and all(kinds[f] for f in folders):
        # Train/ + Val/ without a test split: training them as two classes learns nothing.
        missing = [s for s in ("train", "test") if s not in {kinds[f] for f in folders}]
        raise UserError(f"{str(root)!r} holds {', '.join(f.name + '/' for f in folders)}: split "
                        f"folders, not classes, and no {' or '.join(missing)} split; expected "
                        "train/<class> + test/<class> (+ val/<class>), or a folder of class "
                        "folders.")
    # A class may be named train (beside bus/, car/), but a test/ or val/ beside classes holds
    # a split of them: as a class, it would mix every class's images under one label.
    splits = [f.name for f in folders if kinds[f] in ("test", "val")]
    if splits:
        raise UserError(f"{str(root)!r} holds {', '.join(s + '/' for s in splits)} beside "
                        f"{', '.join(f.name + '/' for f in folders if f.name not in splits)}: "
                        "split folders are not classes; expected train/<class> + "
                        "test/<class> (+ val/<class>), or a folder of class folders only.")
    if folders:
        return "class folders", {"all": root}
    raise UserError(f"{str(root)!r} has no class folders: expected seg_train/seg_train/<class> "
                    "(Intel), train/<class> + test/<class>, or <class>/ folders of images.")


def _child(folder: Path, *parts: str) -> Path:
    """folder/part/..., each part matched regardless of case (Train/, TEST/, Val/), the exact
    name first; the exact path when nothing matches."""
    for part in parts:
        exact = folder / part
        try:
            folder = exact if exact.is_dir() else next(
                (p for p in folder.iterdir() if p.name.lower() == part and p.is_dir()), exact)
        except OSError:  # not a folder, or unreadable
            folder = exact
    return folder


def class_name(folder: Path) -> str:
    """A class folder's name as charts and logs can print it: a name that is not UTF-8 (zips
    made on Windows) is written with escapes, b"caf\xe9" as 'caf\\xe9'; and in Unicode's
    composed form (NFC), so that a test/ folder written on macOS (decomposed) names the same
    classes as train/."""
    return unicodedata.normalize("NFC", printable(folder.name))


def printable(text: str) -> str:
    """A file name as it can be printed and written in UTF-8: bytes that are not UTF-8 (kept by
    the file system as surrogates) with escapes, b"caf\xe9" as 'caf\\xe9'."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# Folders that archivers and Python leave beside the data: never a class. Any other name is
# (a class may be named __background__ or _other).
TOOL_FOLDERS = {"__macosx", "__pycache__"}


def _class_dirs(folder: Path) -> list[Path]:
    """Class folders: all but hidden ones and tools' own (TOOL_FOLDERS), by name, upper case
    first on every system (Windows sorts paths ignoring case: a copy of the data there would
    draw other splits from the same seed). A link whose target is gone (a drive not mounted)
    stops the run in one line: neither a folder nor a file, it would drop a whole class (or
    split) without a word. (A broken link named as an image is an image, skipped and
    counted where images are read.)"""
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    broken = [p for p in entries if p.is_symlink() and not p.exists()
              and p.suffix.lower() not in IMAGE_EXTS]
    if broken:
        raise UserError(f"{str(broken[0])!r} is a link to {os.readlink(broken[0])!r}, which "
                        "does not exist (a drive not mounted?); fix the link or remove it.")
    return sorted((p for p in entries if p.is_dir() and p.name.lower() not in TOOL_FOLDERS),
                  key=lambda p: p.name)


def _split_folder_in(folder: Path) -> Path | None:
    """A folder inside a class folder named as a split (train/, test/ ...), or None. Only
    entries so named are stat'ed: a class folder holds thousands of images, on Drive slow to
    stat."""
    with os.scandir(folder) as entries:
        return next((Path(e.path) for e in entries if not e.name.startswith(".")
                     and split_of(e.name) and e.is_dir()), None)


def _loose_images(folder: Path) -> int:
    """Image files directly in `folder` (not hidden): beside class or split folders, in no
    class."""
    return sum(1 for p in folder.iterdir() if not p.name.startswith(".") and p.is_file()
               and p.suffix.lower() in IMAGE_EXTS)


def _image_files(folder: Path, seen: dict[str, Path], ignored: dict[str, int]
                 ) -> tuple[list[Path], int]:
    """Candidate image files below a class folder (hidden files are ignored; other files are
    counted in `ignored` by extension) and how many were left out as already listed.

    Links are followed (data folders are often linked in), but a real directory is entered
    once and a link back to the folder or above it not at all: a loop would list images
    without end, into every split. A file reached twice, here or through `seen` (real path or
    hard-linked inode -> the path first listed, shared across a dataset's folders), is listed
    once."""
    root = os.path.realpath(folder)
    entered, found, repeats = {root}, [], 0
    stack = [(str(folder), root)]
    while stack:
        path, real = stack.pop()
        # A folder that cannot be listed is not skipped, as os.walk would: its images would
        # vanish from the counts without a word. PermissionError becomes index_dataset's line.
        try:
            entries = sorted(os.scandir(path), key=lambda entry: entry.name)
        except PermissionError:
            raise
        except OSError as exc:
            raise UserError(f"cannot list {path!r} in the data folder ({exc.strerror or exc}); "
                            "fix it or move it out of the data folder.") from None
        subdirs = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            target = os.path.realpath(entry.path) if entry.is_symlink() else \
                os.path.join(real, entry.name)
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if target not in entered and not (root + os.sep).startswith(
                        target.rstrip(os.sep) + os.sep):
                    entered.add(target)
                    subdirs.append((entry.path, target))
            elif Path(entry.name).suffix.lower() in IMAGE_EXTS:
                target = _file_identity(entry, target)
                if target in seen:
                    repeats += 1
                else:
                    seen[target] = Path(entry.path)
                    found.append(Path(entry.path))
            else:
                kind = Path(entry.name).suffix.lower() or "no extension"
                ignored[kind] = ignored.get(kind, 0) + 1
        stack.extend(reversed(subdirs))  # depth first, in name order, as os.walk lists them
    return found, repeats


def _file_identity(entry: os.DirEntry, real: str) -> str:
    """A file's key among those listed: its real path, or for a file with several hard links
    (DVC's hardlink cache, `cp -al`, `rsync --link-dest`) its device and inode, which each of
    its names shares. Keyed by inode only then: a one-link file cannot be another's second
    name, and file systems whose inode numbers are not unique stay read file by file."""
    try:
        info = entry.stat()
        if info.st_nlink == 0:  # Windows' DirEntry leaves links and inodes out
            info = os.stat(entry.path)
    except OSError:
        return real  # check_image says why it cannot be read
    return f"inode:{info.st_dev}:{info.st_ino}" if info.st_nlink > 1 else real


def check_image(path: Path, sizes: dict[str, int] | None = None) -> str | None:
    """None when the file decodes, else a short reason. JPEGs decode at reduced scale (fast).
    `sizes` gets the file's size in bytes by its path (for DatasetIndex.fingerprint). A read
    the disk or drive failed (IO_FAILED) is tried once more, then stops the run: skipped, a
    readable image would leave the data set, and a resume would refuse the run as other data."""
    try:
        return _check_image(path, sizes)
    except OSError:
        try:
            return _check_image(path, sizes)
        except OSError as exc:
            raise (io_failed(path, exc) or exc) from None


def _check_image(path: Path, sizes: dict[str, int] | None) -> str | None:
    try:
        size = path.stat().st_size
        if sizes is not None:
            sizes[str(path)] = size
        if size == 0:
            return "empty file"
        with Image.open(path) as img:
            img.draft("RGB", (64, 64))  # DCT-domain downscale: reads every byte, decodes 1/8
            img.load()
            if img.width < 1 or img.height < 1:
                return "no pixels"
            to_rgb(upright(img))  # the rest of what training's decode does, on the small image
        return None
    except PermissionError:
        return "unreadable (permission denied)"
    except FileNotFoundError:  # a link whose target is gone: its path, cut at 60, said less
        return "a link to a missing file" if path.is_symlink() else "no longer there"
    except Image.DecompressionBombError:
        return "too large (decompression bomb guard)"
    except OSError as exc:
        if exc.errno in IO_FAILED:
            raise  # check_image's to try again
        msg = str(exc)
        return "truncated" if "truncated" in msg.lower() else ("not an image" if "identify" in msg else msg[:60])
    except Exception as exc:  # PIL raises assorted errors for malformed headers
        return f"undecodable ({type(exc).__name__})"


CHECK_SAID_FROM = 2000  # images in a split: checking or decoding them is said as it starts


def in_threads(read: Callable, paths: list) -> dict:
    """{path: read(path)}, the files read in threads (their I/O overlaps)."""
    with ThreadPoolExecutor(max_workers=min(8, usable_cpus() * 2)) as pool:
        return dict(zip(paths, pool.map(read, paths)))


def _check_images(paths: list, sizes: dict[str, int]) -> dict:
    """check_image of each path (a Path or its str), in threads, by the path as given."""
    return in_threads(lambda p: check_image(Path(p), sizes), paths)


def _scan_split(folder: Path, split: str, check: bool, seen: dict[str, Path],
                ignored: dict[str, int], sizes: dict[str, int], numbered_below: int | None = None
                ) -> tuple[dict[str, list[Path]], list[tuple[str, str]]]:
    classes = _class_dirs(folder)
    if not classes:
        raise UserError(f"the {split} folder {str(folder)!r} has no class folders.")
    # <class>/train/ and <class>/test/: read as one class each, the held-out images would be
    # trained on and another test split drawn, without a word.
    inner = [_split_folder_in(c) for c in classes]
    if len(classes) > 1 and all(inner):
        raise UserError(f"the class folders in {str(folder)!r} hold split folders "
                        f"({inner[0].relative_to(folder).as_posix()}/ ...): this reads "
                        "train/<class>/ and test/<class>/, or class folders alone; move the "
                        "images so.")
    loose = _loose_images(folder)
    if loose:
        ignored[OUTSIDE_CLASSES] = ignored.get(OUTSIDE_CLASSES, 0) + loose
    names = [class_name(c) for c in classes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # one class would hide the other's images
        raise UserError(f"the {split} folder {str(folder)!r} has two class folders named "
                        f"{twice[0]!r} (the same letters in other Unicode forms); rename one.")
    # files of formats this does not read, by extension: per class for a class left with none
    others: dict[str, dict[str, int]] = {name: {} for name in names}
    listed = {name: _image_files(c, seen, others[name]) for name, c in zip(names, classes)}
    for counts in others.values():
        for kind, n in counts.items():
            ignored[kind] = ignored.get(kind, 0) + n
    per_class = {name: files for name, (files, _) in listed.items()}
    if numbered_below is not None:
        per_class = {name: [p for p in files if p.stem.isdigit() and int(p.stem) < numbered_below]
                     for name, files in per_class.items()}
    repeats = sum(n for _, n in listed.values())
    if repeats:
        log.warning("the %s split reaches %d image file(s) a second time through links; each "
                    "is counted once, where first found.", split, repeats)
    skipped: list[tuple[str, str]] = []
    if check:
        every = [p for files in per_class.values() for p in files]
        if len(every) >= CHECK_SAID_FROM:  # seconds of silence otherwise, minutes on Drive
            log.info("checking that the %d images of %s decode ...", len(every),
                     f"the {split} split" if split != "all" else "the folder")
        reasons = _check_images(every, sizes)
        skipped = [(str(p), r) for p, r in reasons.items() if r is not None]
        undecodable = {c: sum(reasons[p] is not None for p in files)
                       for c, files in per_class.items()}
        per_class = {c: [p for p in files if reasons[p] is None] for c, files in per_class.items()}
    for name, files in per_class.items():
        if not files:
            bad = undecodable[name] if check else 0
            other = ", ".join(f"{n} {kind}" for kind, n in sorted(
                others[name].items(), key=lambda kv: -kv[1])[:4])
            extra = f" ({bad} undecodable files skipped)" if bad else \
                (" (its images were already counted elsewhere through links)"
                 if listed[name][1] else f" (it holds {other}; this reads "
                 f"{' '.join(sorted(IMAGE_EXTS))})" if other else "")
            where = f"the {split} split" if split != "all" else repr(str(folder))
            raise UserError(f"class {name!r} in {where} has no usable images{extra}.")
    return per_class, skipped


def _seeded_split(per_class: dict[str, list[Path]], fraction: float, seed: int
                  ) -> tuple[dict[str, list[Path]], dict[str, list[Path]]]:
    """Stratified split: about `fraction` of each class (at least one when it has two or more)."""
    rng = np.random.default_rng(seed)
    kept, held = {}, {}
    for name, files in per_class.items():
        order = rng.permutation(len(files))
        n_held = min(len(files) - 1, max(1, round(fraction * len(files))))
        held[name] = sorted((files[i] for i in order[:n_held]), key=_path_order)
        kept[name] = sorted((files[i] for i in order[n_held:]), key=_path_order)
    return kept, held


def _path_order(path: Path) -> tuple[str, ...]:
    """Paths in POSIX's order on every system (Windows' ignores case)."""
    return path.parts


def _val_share(per_class: dict[str, list[Path]], fraction: float) -> float:
    """`fraction`, raised towards MIN_VAL_IMAGES (at most MAX_VAL_FRACTION) for small sets."""
    n = sum(len(files) for files in per_class.values())
    return max(fraction, min(MAX_VAL_FRACTION, MIN_VAL_IMAGES / max(1, n)))


HELD_OUT_ORDER = ("test", "val", "train")  # the most held out first
SPLIT_ADJECTIVES = {"train": "training", "val": "validation", "test": "test"}


def _digest_file(path: str) -> str | None:
    digest = hashlib.sha1()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None  # gone since it was checked: training says so when it reads it


def identical_files(paths: list[str], sizes: dict[str, int]) -> list[list[str]]:
    """Groups of two or more paths whose files hold the same bytes. Only files whose size
    another file shares are read (sizes: bytes by path, as check_image records them)."""
    by_size: dict[int, list[str]] = {}
    for path in paths:
        if path in sizes:
            by_size.setdefault(sizes[path], []).append(path)
    shared = [p for group in by_size.values() if len(group) > 1 for p in group]
    digests = in_threads(_digest_file, shared)
    groups: dict[tuple[int, str], list[str]] = {}
    for path, digest in digests.items():
        if digest is not None:
            groups.setdefault((sizes[path], digest), []).append(path)
    return [group for group in groups.values() if len(group) > 1]


def leave_out_copies(index: DatasetIndex) -> DatasetIndex:
    """The index without the images that are byte-identical copies of an image in a more
    held-out split (a training copy of a test image, of a validation image; a validation copy
    of a test image), whatever their labels: trained on, or chosen by, such a copy, the test
    (validation) accuracy counts it as unseen. Each left out is recorded in index.copies with
    the image it copies, and said."""
    split_of = {path: split for split in HELD_OUT_ORDER for path, _ in getattr(index, split)}
    left_out: dict[str, str] = {}
    for group in identical_files(list(split_of), index.sizes):
        kept = min(group, key=lambda p: (HELD_OUT_ORDER.index(split_of[p]), _path_order(Path(p))))
        rank = HELD_OUT_ORDER.index(split_of[kept])
        left_out.update({p: kept for p in group if HELD_OUT_ORDER.index(split_of[p]) > rank})
    if not left_out:
        return index
    copies = sorted(left_out.items(), key=lambda pair: _path_order(Path(pair[0])))
    counts = Counter(split_of[p] for p in left_out)
    rel = lambda path: os.path.relpath(path, index.root)  # noqa: E731
    held = {split_of[kept] for kept in left_out.values()}
    log.warning("left out %s: byte-identical copies of %s images (e.g. %s), so that those "
                "measure images the model was not trained or chosen on; listed in the run's %s",
                " and ".join(f"{counts[s]} {SPLIT_ADJECTIVES[s]} image(s)" for s in ("train", "val")
                             if counts[s]),
                " or ".join(SPLIT_ADJECTIVES[s] for s in ("val", "test") if s in held),
                "; ".join(f"{rel(p)} = {rel(k)}" for p, k in copies[:2]), COPIES_LIST)
    unseen = replace(index, copies=copies, **{
        split: [s for s in getattr(index, split) if s[0] not in left_out]
        for split in ("train", "val")})
    for split, of in (("train", "a validation or test image"), ("val", "a test image")):
        had = {label for _, label in getattr(index, split)}
        bare = sorted(had - {label for _, label in getattr(unseen, split)})
        if bare:  # a val/ copied from test/ would choose every model by the test images
            raise UserError(f"every {SPLIT_ADJECTIVES[split]} image of class "
                            f"{index.classes[bare[0]]!r} is a byte-identical copy of {of}; "
                            "give it images of its own" + (
                                "; if a val folder copies the test folder, remove it "
                                "(validation is then held out of train)" if split == "val"
                                else "") + ".")
    return unseen


def index_dataset(root: Path, name: str | None = None, *, seed: int = DEFAULT_SEED,
                  check: bool = True,
                  val_fraction: float = VAL_FRACTION,
                  numbered_below: dict[str, int] | None = None) -> DatasetIndex:
    """Find the layout, list and check every image, and split train/val/test.
    numbered_below: {split: n} keeps only the files named 0..n-1 in each class of that split:
    the generated set, whose folder also holds the images a larger preset asked for."""
    root = Path(root)
    started = time.perf_counter()
    if not root.is_dir():
        raise UserError(f"data folder {str(root)!r} does not exist.")
    if not os.access(root, os.R_OK | os.X_OK):
        raise UserError(f"cannot read the data folder {str(root)!r} (permission denied); fix "
                        "its permissions.")
    try:
        layout, folders = find_splits(root)
        if layout == "intel":  # its seg_pred/ holds images without labels
            unused = [f.name for f in _class_dirs(root)
                      if f.name.lower() not in ("seg_train", "seg_test")]
            if unused:
                log.info("%r: %s beside seg_train/ and seg_test/ %s not used (images without "
                         "labels: predict() classifies them)", str(root),
                         ", ".join(f"{u}/" for u in unused), "is" if len(unused) == 1 else "are")
        scanned, skipped, seen, ignored, sizes = {}, [], {}, {}, {}
        # Images beside the split folders (train/, seg_train/seg_train/) are in no split.
        above = {parent for folder in folders.values() if folder != root
                 for parent in folder.parents if parent == root or root in parent.parents}
        loose = sum(_loose_images(folder) for folder in above)
        if loose:
            ignored[OUTSIDE_CLASSES] = loose
        for split, folder in folders.items():
            scanned[split], bad = _scan_split(folder, split, check, seen, ignored, sizes,
                                              (numbered_below or {}).get(split))
            skipped += bad
    except PermissionError as exc:  # a read, not a write: pipeline's message would say write
        raise UserError(f"cannot read {exc.filename or str(root)!r} in the data folder "
                        "(permission denied); fix its permissions.") from None
    if layout == "class folders":
        rest, scanned["test"] = _seeded_split(scanned.pop("all"), 0.2, seed)
        scanned["train"], scanned["val"] = _seeded_split(rest, _val_share(rest, val_fraction),
                                                         seed + 1)
    elif "val" not in scanned:
        scanned["train"], scanned["val"] = _seeded_split(
            scanned["train"], _val_share(scanned["train"], val_fraction), seed)
    classes = sorted(scanned["train"])
    if len(classes) < 2:
        deeper = _one_level_deeper(root, folders.get("train", root), classes[0])
        raise UserError(f"a classifier needs at least 2 classes, but {str(root)!r} has one, "
                        f"{classes[0]!r}{deeper}.")
    for split in ("val", "test"):
        if sorted(scanned[split]) != classes:
            only_train = sorted(set(classes) - set(scanned[split]))
            only_other = sorted(set(scanned[split]) - set(classes))
            # quoted where a space at an end or an unprintable letter would hide the difference
            shown = lambda names: ", ".join(  # noqa: E731
                repr(n) if n != n.strip() or not n.isprintable() else n for n in names)
            parts = ([f"only in train: {shown(only_train)}"] if only_train else []) + \
                    ([f"only in {split}: {shown(only_other)}"] if only_other else [])
            raise UserError(f"train and {split} have different classes ({'; '.join(parts)}).")
    to_samples = lambda per: [(str(p), classes.index(c)) for c in classes for p in per[c]]  # noqa: E731
    index = DatasetIndex(name=name or root.name, root=root, layout=layout, classes=classes,
                         train=to_samples(scanned["train"]), val=to_samples(scanned["val"]),
                         test=to_samples(scanned["test"]), skipped=skipped, ignored=ignored,
                         sizes=sizes)
    if check:  # the sizes of every image are known: copies are found by reading few files
        index = leave_out_copies(index)
    index.read_s = time.perf_counter() - started
    for split, what in (("val", "validation"), ("test", "test")):
        if not getattr(index, split):  # nothing to choose by or report: refused before training
            need = "at least 3 images" if layout == "class folders" else \
                "at least 2 training images, or add a val folder beside train"
            raise UserError(f"too few images to set aside a {what} split: {index.n_images()} "
                            f"usable images in {len(classes)} classes in {str(root)!r}; give "
                            f"each class {need}.")
        present = {label for _, label in getattr(index, split)}
        missing = [c for i, c in enumerate(classes) if i not in present]
        if missing:  # a class of one or two images: the seeded split left it out
            log.warning("%s %s %s no %s images (too few images to split): %s %s accuracy is "
                        "not measured", "class" if len(missing) == 1 else "classes",
                        ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else ""),
                        "has" if len(missing) == 1 else "have", what,
                        "its" if len(missing) == 1 else "their", what)
    if ignored.get(OUTSIDE_CLASSES):
        log.warning("ignored %d image(s) outside the class folders, in no class; move them "
                    "into their class's folder to use them.", ignored[OUTSIDE_CLASSES])
    kinds = sorted(((k, n) for k, n in ignored.items() if k != OUTSIDE_CLASSES),
                   key=lambda kv: -kv[1])
    if kinds:
        log.warning("ignored %d file(s) of formats this does not read (%s%s); it reads %s.",
                    sum(n for _, n in kinds), ", ".join(f"{k}: {n}" for k, n in kinds[:4]),
                    ", ..." if len(kinds) > 4 else "", " ".join(sorted(IMAGE_EXTS)))
    _say_skipped(root, skipped)
    return index


def _say_skipped(root: Path, skipped: list[tuple[str, str]]) -> None:
    if skipped:
        examples = "; ".join(f"{os.path.relpath(p, root)}: {r}" for p, r in skipped[:3])
        log.warning("skipped %d undecodable image file(s) (%s%s); counted in skipped_files%s.",
                    len(skipped), examples, "; ..." if len(skipped) > 3 else "",
                    f", all listed in the run's {SKIPPED_LIST}" if len(skipped) > 3 else "")


def _one_level_deeper(root: Path, parent: Path, only: str) -> str:
    """For a lone class folder `only` in `parent` (the data folder, or its train split): what
    would make its folders the classes."""
    folder = next((p for p in _class_dirs(parent) if class_name(p) == only), None)
    inner = [class_name(p) for p in _class_dirs(folder)] if folder is not None else []
    if not inner:
        return ""
    shown = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
    if parent != root:  # train/<only>/<classes>: a level too deep inside the splits
        return (f"; {str(parent)!r} holds one folder, {only!r}: if the folders in it ({shown}) "
                "are the classes, move them up one level in each split")
    rename = ", renamed: its name is not UTF-8" if folder.name != only else ""
    try:
        inside = find_splits(folder)[0]
    except UserError:
        inside = None
    if inside not in (None, "class folders"):  # an archive unpacked into a folder of its own
        return (f"; it holds split folders ({shown}): pass --data-dir "
                f"{str(root / only)!r}{rename}")
    return f"; if the folders in it ({shown}) are the classes, pass --data-dir " \
        f"{str(root / only)!r}{rename}"


def subset(index: DatasetIndex, per_class: dict[str, int], seed: int = DEFAULT_SEED,
           usable: Callable[[str], bool] | None = None) -> DatasetIndex:
    """n images of each class in each split, e.g. {"train": 60, "val": 12, "test": 30}: a
    seeded sample, in the split's order (the first n by name could be one camera's, one
    source's). The test split's is drawn with seed 0 whatever `seed`, so runs of other seeds
    test on the same images. usable(path): whether a drawn image can be read; one that cannot
    is replaced by the next of its class's other images in an order seeded for that class
    alone (so every other draw stays as it was, and the test images the same for every
    seed)."""
    def take(split: str, samples: list[Sample], n: int) -> list[Sample]:
        stream = f"{0 if split == 'test' else seed}:{split}"
        rng = random.Random(stream)
        by_class: dict[int, list[int]] = {}
        for i, (_, label) in enumerate(samples):
            by_class.setdefault(label, []).append(i)
        keep: set[int] = set()
        for label, members in by_class.items():
            drawn = members if len(members) <= n else rng.sample(members, n)
            if usable is not None:
                good = [i for i in drawn if usable(samples[i][0])]
                rest = sorted(set(members) - set(drawn))
                for i in random.Random(f"{stream}:{label}").sample(rest, len(rest)):
                    if len(good) == len(drawn):
                        break
                    if usable(samples[i][0]):
                        good.append(i)
                drawn = good
            keep.update(drawn)
        return [s for i, s in enumerate(samples) if i in keep]
    return replace(index, **{split: take(split, getattr(index, split), n)
                             for split, n in per_class.items()})


def index_subset(root: Path, name: str | None, per_class: Callable[[int], dict[str, int]], *,
                 seed: int = DEFAULT_SEED, numbered_below: dict[str, int] | None = None
                 ) -> DatasetIndex:
    """subset(index, per_class(classes), seed) of an index of the folder, checking only the
    images it draws (--quick on a 60,000-image folder spent 17 of its 24 s checking images it
    then left out), an undecodable one replaced from its class (subset's `usable`): the same
    sample and fingerprint as checking the whole folder first where every image decodes."""
    started = time.perf_counter()
    listed = index_dataset(root, name, seed=seed, check=False, numbered_below=numbered_below)
    counts = per_class(len(listed.classes))
    drawn = subset(listed, counts, seed=seed)
    paths = [p for split in counts for p, _ in getattr(drawn, split)]
    if len(paths) >= CHECK_SAID_FROM:
        log.info("checking that the %d images drawn decode ...", len(paths))
    sizes: dict[str, int] = {}
    reasons = _check_images(paths, sizes)

    def usable(path: str) -> bool:
        if path not in reasons:
            reasons[path] = check_image(Path(path), sizes)
        return reasons[path] is None
    if not all(usable(p) for p in paths):
        drawn = subset(listed, counts, seed=seed, usable=usable)
        for split in counts:  # as indexing the whole folder says it
            lost = {label for _, label in getattr(listed, split)} - \
                {label for _, label in getattr(drawn, split)}
            if lost:
                raise UserError(f"class {listed.classes[min(lost)]!r} in the {split} split has "
                                "no usable images (its undecodable files skipped).")
    skipped = [(p, r) for p, r in reasons.items() if r is not None]
    _say_skipped(Path(root), skipped)
    drawn = leave_out_copies(replace(drawn, sizes=sizes, skipped=skipped))
    drawn.read_s = time.perf_counter() - started
    return drawn


# ----------------------------------------------------------------------------- loading

class ImageListDataset(Dataset):
    """Decodes (path, label) samples per item and applies a PIL transform: the baseline's data path."""

    def __init__(self, samples: list[Sample], transform):
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        try:
            img = load_rgb(path)
        except Exception as exc:
            raise became_unreadable(path, exc, "during training") from None
        return self.transform(img), label


def became_unreadable(path: str, exc: BaseException, when: str) -> UserError:
    """The one line for an indexed image that could no longer be read: a drive's hiccup is the
    drive's line (--resume continues); an image removed or changed names why, and both ways on."""
    if (failed := io_failed(path, exc)) is not None:
        return failed
    why = getattr(exc, "strerror", None) or \
        first_line(exc).replace(f" {path!r}", "").replace(f" {path}", "")  # named already
    return UserError(f"image {path!r} became unreadable {when} ({why}): restore it and rerun "
                     "with --resume, or rerun without --resume to index the folder again.")


class EpochSampler(Sampler[int]):
    """A shuffle that is a pure function of (seed, epoch): resumed runs see the same order."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def make_loader(samples: list[Sample], transform, config: TrainConfig, *, train: bool
                ) -> DataLoader:
    """A DataLoader with the config's loader knobs; training loaders shuffle per epoch."""
    batch_size = config.batch_size
    # Pinned pages only help host-to-GPU copies; without a GPU PyTorch warns and ignores them.
    workers = dict(num_workers=config.num_workers,
                   pin_memory=config.pin_memory and torch.cuda.is_available())
    if config.num_workers > 0:
        workers["persistent_workers"] = config.persistent_workers
        if config.prefetch_factor is not None:
            workers["prefetch_factor"] = config.prefetch_factor
    dataset = ImageListDataset(samples, transform)
    sampler = train_sampler(len(dataset), config.seed) if train else eval_sampler(len(dataset))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      drop_last=drops_last(sampler, batch_size), **workers)


def train_sampler(n: int, seed: int) -> Sampler[int]:
    """The training order over n samples, a function of (seed, epoch) only. Under torchrun one
    equal shard per process (every rank must take the same number of steps); evaluation is
    sharded by eval_sampler."""
    if distributed.world_size() > 1:
        # It seeds with seed + epoch: spread as EpochSampler does, or --seed 42's second epoch
        # would be --seed 43's first.
        return DistributedSampler(range(n), num_replicas=distributed.world_size(),
                                  rank=distributed.rank(), shuffle=True, seed=seed * 100_003,
                                  drop_last=True)
    return EpochSampler(n, seed)


def drops_last(sampler: Sampler[int] | None, batch_size: int) -> bool:
    """Training drops a short last batch when there is more than one: a lone last sample would
    break BatchNorm in train mode. Evaluation keeps every sample."""
    return isinstance(sampler, (EpochSampler, DistributedSampler)) and len(sampler) > batch_size


def steps_per_epoch(config: TrainConfig, n_train: int) -> int:
    """Optimizer steps in an epoch over n_train images: each process's share (train_sampler)
    in batches, less a short last one (drops_last), grad_accum_steps batches a step."""
    return math.ceil(max(1, n_train // distributed.world_size() // config.batch_size)
                     / config.grad_accum_steps)


class EvalShard(Sampler[int]):
    """Under torchrun, this process's share of an evaluation split: every world-th sample from
    its rank, no sample twice and none padded in (DistributedSampler pads), so the ranks'
    summed counts are the split's. `sharded` tells evaluate() to sum across processes."""

    sharded = True

    def __init__(self, n: int):
        self.indices = list(range(distributed.rank(), n, distributed.world_size()))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def eval_sampler(n: int) -> Sampler[int] | None:
    """None (every sample, in order) on one process; this rank's EvalShard under torchrun."""
    return EvalShard(n) if distributed.world_size() > 1 else None


STREAMED = "per-sample PIL decode"  # how make_loader's batches are made


def data_path_of(loader) -> str:
    """How a loader makes its batches: its `data_path` (fastdata.CachedLoader's), else STREAMED."""
    return getattr(loader, "data_path", STREAMED)
