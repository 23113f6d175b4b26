"""Data layer: layouts, mode conversion, bad files, clear errors, the Intel source, loaders."""
from __future__ import annotations

import logging
import pathlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import COLOURS, make_folder, write_image
from modules.config import TrainConfig, UserError
from modules import dataset
from modules.dataset import (EpochSampler, index_dataset, index_subset, load_rgb,
                             resolve_source, subset)
from modules.fastdata import CachedLoader
from modules.files import atomic_write_text
from modules.loaders import make_loaders


@pytest.mark.parametrize("layout", ["intel", "train/test", "class folders"])
def test_layouts_are_found_and_split(tmp_path, layout):
    root = make_folder(tmp_path / "d", layout=layout, n_train=10, n_test=5)
    index = index_dataset(root, "d", seed=1)
    assert index.layout == layout
    assert index.classes == ["blue", "green", "red"]
    assert len(index.train) + len(index.val) + len(index.test) == 45
    assert index.val and index.test and index.skipped_files == 0
    assert not {p for p, _ in index.train} & {p for p, _ in index.val}


def test_a_library_caller_splits_as_the_pipeline_does(tmp_path):
    """index_dataset(root) split with seed 0 where the pipeline's --seed is 42: a library
    caller testing the pipeline's model on index_dataset(root).test counted 8 of 18 images it
    had trained on."""
    import pipeline
    root = make_folder(tmp_path / "d", layout="class folders", n_train=8, n_test=3)
    args = pipeline.parse_args(["--data-dir", str(root), "--output-dir", str(tmp_path / "o")])
    assert index_dataset(root, "d") == pipeline.load_data(args, tmp_path / "o")


def test_intel_s_unlabelled_seg_pred_is_said_to_be_unused(tmp_path, caplog):
    """Intel's download holds seg_pred/ (7,301 images without labels) beside the two splits:
    nothing said it was left out."""
    root = make_folder(tmp_path / "intel", layout="intel", n_train=4, n_test=2)
    write_image(root / "seg_pred" / "seg_pred" / "1.jpg", COLOURS["red"])
    with caplog.at_level(logging.INFO, logger="modules.dataset"):
        index_dataset(root)
    assert f"{str(root)!r}: seg_pred/ beside seg_train/ and seg_test/ is not used (images " \
        "without labels: predict() classifies them)" in caplog.text


@pytest.mark.parametrize("name", ["val", "valid", "Validation"])
def test_val_folder_is_used_when_present(folder, name):
    for c in COLOURS:
        write_image(folder / name / c / "v.png", COLOURS[c])
    index = index_dataset(folder)
    assert len(index.val) == 3 and len(index.train) == 36


def test_split_folders_in_other_names_and_cases(tmp_path):
    """Training/ + Testing/ (Kaggle's Brain Tumor MRI) are splits; Train/ + Val/ without a test
    split are not two classes to learn."""
    for split in ("Training", "Testing"):
        for c in COLOURS:
            for i in range(3):
                write_image(tmp_path / "mri" / split / c / f"{i}.png", COLOURS[c])
    index = index_dataset(tmp_path / "mri")
    assert index.layout == "train/test" and len(index.test) == 9 and index.classes == \
        sorted(COLOURS)
    for split in ("Train", "Val"):
        for c in COLOURS:
            write_image(tmp_path / "tv" / split / c / "0.png", COLOURS[c])
    with pytest.raises(UserError, match="split folders, not classes"):
        index_dataset(tmp_path / "tv")


@pytest.mark.parametrize("train, test", [("training_set/training_set", "test_set/test_set"),
                                         ("train_data", "test-data"),
                                         ("train/train", "test/test")])
def test_split_folders_named_with_a_set_word_or_doubled_are_splits_not_classes(
        tmp_path, train, test):
    """Kaggle's Cats-and-Dogs unpacks to training_set/training_set/<class> + test_set/test_set/:
    it trained "test_set vs training_set" as two classes, without a word."""
    root = tmp_path / "d"
    for split, n in ((train, 6), (test, 3)):
        for c in ("cats", "dogs"):
            for i in range(n):
                write_image(root / split / c / f"{i}.png", COLOURS["red" if c == "cats" else
                                                                 "blue"])
    index = index_dataset(root)
    assert index.layout == "train/test" and index.classes == ["cats", "dogs"]
    assert len(index.test) == 6 and len(index.train) + len(index.val) == 12


def test_a_class_whose_name_starts_with_a_split_word_stays_a_class(tmp_path, caplog):
    for c in ("test_tube", "beaker", "Test Set"):  # Test Set/ of images: a class, not a split
        for i in range(6):
            write_image(tmp_path / "lab" / c / f"{i}.png", COLOURS["red"])
    assert index_dataset(tmp_path / "lab").classes == ["Test Set", "beaker", "test_tube"]
    # an unlabelled val_images/ of loose images beside train/ and test/: not the val split
    # (it was refused as "the val folder has no class folders"), named and left unused
    root = make_folder(tmp_path / "d", n_train=4, n_test=2)
    for i in range(3):
        write_image(root / "val_images" / f"{i}.png", COLOURS["red"])
    with caplog.at_level(logging.WARNING):
        index = index_dataset(root)
    assert index.layout == "train/test" and "val_images/ beside train/ and test/" in caplog.text


def test_split_folders_without_train_say_train_is_missing(tmp_path):
    for split in ("test", "val"):
        for c in COLOURS:
            write_image(tmp_path / "d" / split / c / "0.png", COLOURS[c])
    with pytest.raises(UserError, match=r"not classes, and no train split"):
        index_dataset(tmp_path / "d")


def test_the_quick_subset_is_a_seeded_sample_and_its_test_part_the_same_for_every_seed(tmp_path):
    """By name, the first images of a class can all be one source's (camA_ before camB_)."""
    for split, n in (("train", 40), ("test", 20)):
        for c in ("red", "blue"):
            for source in ("camA", "camB"):
                for i in range(n):
                    write_image(tmp_path / "d" / split / c / f"{source}_{i:03d}.png", COLOURS[c])
    index = index_dataset(tmp_path / "d")
    one, same, other = (subset(index, {"train": 20, "test": 10}, seed=s) for s in (1, 1, 2))
    sources = {Path(p).name[:4] for p, _ in one.train}
    assert sources == {"camA", "camB"} and one.train == same.train and one.train != other.train
    assert one.test == other.test and len(one.test) == 20
    assert {Path(p).name[:4] for p, _ in one.test} == {"camA", "camB"}


def test_a_folder_beside_train_and_test_is_named_not_silently_dropped(folder, caplog):
    for c in COLOURS:
        write_image(folder / "extra" / c / "v.png", COLOURS[c])
    with caplog.at_level(logging.WARNING):
        index = index_dataset(folder)
    assert len(index.train) + len(index.val) == 36
    assert any("extra/ beside train/ and test/ is not used" in r.getMessage()
               for r in caplog.records)


def test_class_folders_split_a_fifth_of_each_class_for_test_and_a_share_for_validation(
        tmp_path, caplog):
    """The README's split of a folder of class folders: a seeded 20% of each class tested (one
    image of a class of two: its accuracy is measured), then 25% of the rest for validation (a
    small set's share, toward 500 images), no image in two splits."""
    sizes = {"red": 15, "green": 10, "blue": 2}
    for c, n in sizes.items():
        for i in range(n):
            write_image(tmp_path / "d" / c / f"{i}.png", COLOURS[c], size=8)
    with caplog.at_level(logging.WARNING):
        index = index_dataset(tmp_path / "d", seed=2)
    assert index.layout == "class folders"

    def per_class(split):
        return {c: sum(index.classes[label] == c for _, label in split) for c in sizes}
    assert per_class(index.test) == {"red": 3, "green": 2, "blue": 1}
    assert per_class(index.val) == {"red": 3, "green": 2, "blue": 0}  # 25% of 12, 8 and 1
    assert per_class(index.train) == {"red": 9, "green": 6, "blue": 1}
    train, val, test = ({p for p, _ in split} for split in (index.train, index.val, index.test))
    assert not test & train and not test & val and not train & val
    assert len(train | val | test) == sum(sizes.values())
    assert "no validation images" in caplog.text and "blue" in caplog.text


def test_validation_takes_the_share_of_train_that_makes_500_images(tmp_path):
    """Between a small set's 25% and a large set's 10%, the validation share of train is the
    one that makes about MIN_VAL_IMAGES (500) images in all: fewer cannot separate the tuners'
    candidates, more would be taken from training for nothing."""
    for split, n in (("train", 1600), ("test", 2)):
        for c in ("cats", "dogs"):
            (tmp_path / "d" / split / c).mkdir(parents=True)
            for i in range(n):
                (tmp_path / "d" / split / c / f"{i}.jpg").touch()
    index = index_dataset(tmp_path / "d", check=False)
    assert len(index.val) == 500 and len(index.train) == 3200 - 500
    assert {label for _, label in index.val} == {0, 1}


def test_a_long_folder_name_is_cut_to_a_name_files_can_carry(tmp_path):
    """A 240-character folder name (legal on Linux and NTFS) made `.<name>_model.pt.<hex>.tmp`
    longer than 255 bytes: every run failed after its first scenario. Two such folders that
    differ only past the cut keep apart."""
    a, b = ("d" * 230 + tail for tail in ("-a", "-b"))
    for name in (a, b):
        (tmp_path / name).mkdir()
    name_a, name_b = (resolve_source("synthetic", tmp_path / n, tmp_path)[1] for n in (a, b))
    assert len(name_a) == len(name_b) == 200 and name_a != name_b
    assert name_a.startswith("d" * 191 + "-")
    (tmp_path / "out").mkdir()
    atomic_write_text("x", tmp_path / "out" / f"{name_a}_model.other-data-0123abcd.pt")
    for kept in ("short name", "e" * 200):  # names that worked stay as they were
        (tmp_path / kept).mkdir()
        assert resolve_source("synthetic", tmp_path / kept, tmp_path)[1] == kept.replace(" ", "_")


def test_checking_a_large_split_is_said_and_timed(folder, monkeypatch, caplog, tmp_path):
    """Checking that 15,000 images decode took 3.4 s here (more on Drive) with nothing said,
    and run.log did not show it: said as it starts, its seconds on run.log's data line."""
    import scenario
    from modules import dataset
    monkeypatch.setattr(dataset, "CHECK_SAID_FROM", 5)
    with caplog.at_level(logging.INFO, logger="modules.dataset"):
        index = index_dataset(folder)
    assert "checking that the 36 images of the train split decode" in caplog.text
    assert 0 < index.read_s < 60 and subset(index, {"train": 2}).read_s == index.read_s
    index.read_s = 3.44
    assert scenario.data_record(index, tmp_path)[0].endswith("(listed and checked in 3.4 s)")


def test_a_copy_on_windows_draws_the_same_splits(tmp_path, monkeypatch):
    """Windows sorts paths ignoring case: folders and files whose names mix cases, indexed
    there, drew other splits from the same seed (another fingerprint: a resume or a comparison
    with a Colab run refused). Names are ordered as POSIX orders them, on every system."""
    for c in ("Zebra", "apple", "Mango"):
        for name in ("B", "a", "C", "d", "E", "f"):
            write_image(tmp_path / "d" / c / f"{name}.png", COLOURS["red"], size=8, seed=len(name))
    here = index_dataset(tmp_path / "d", seed=42, check=False)
    monkeypatch.setattr(pathlib.PurePath, "__lt__", lambda a, b: str(a).lower() < str(b).lower())
    assert sorted([Path("b"), Path("A")]) == [Path("A"), Path("b")]  # patched: Windows' order
    assert sorted([Path("B"), Path("a")]) == [Path("a"), Path("B")]
    there = index_dataset(tmp_path / "d", seed=42, check=False)
    assert there.classes == here.classes == ["Mango", "Zebra", "apple"]
    assert (there.train, there.val, there.test) == (here.train, here.val, here.test)
    assert there.fingerprint() == here.fingerprint()


def test_seeded_split_is_reproducible_and_differs_by_seed(folder):
    a, b, c = (index_dataset(folder, seed=s) for s in (3, 3, 4))
    assert a.val == b.val
    assert a.val != c.val


def test_the_fingerprint_is_the_images_and_split_not_where_the_folder_is(folder, tmp_path,
                                                                          monkeypatch):
    """A copy of the folder, another machine's download or a relative --data-dir is the same
    data; another split, a moved, removed or rewritten image (the set resized under the same
    names) is not. A fingerprint an older version recorded (from the paths as listed) is still
    this data's, at the folder's own place."""
    import shutil
    here = index_dataset(folder, seed=3)
    copy = index_dataset(shutil.copytree(folder, tmp_path / "elsewhere" / "data"), seed=3)
    monkeypatch.chdir(folder.parent)
    relative = index_dataset(Path(folder.name), seed=3)
    monkeypatch.chdir(folder)
    dot = index_dataset(Path("."), seed=3)
    assert here.fingerprint() == copy.fingerprint() == relative.fingerprint() == dot.fingerprint()
    assert here.train[0][0] != copy.train[0][0]  # the paths differ, the data does not
    older = here._digest(("train", "val", "test"), str)
    assert here.same_data(older) and relative.same_data(here.fingerprint())
    assert not copy.same_data(older) and not here.same_data(None)
    assert here.fingerprint() != index_dataset(folder, seed=4).fingerprint()
    # the images, whichever validation holds out (another --seed): the same
    assert here.images_fingerprint() == index_dataset(folder, seed=4).images_fingerprint() \
        == copy.images_fingerprint() != here.fingerprint()
    flat = shutil.copytree(folder / "train", tmp_path / "flat")  # <class>/ folders: test drawn
    assert index_dataset(flat, seed=3).fingerprint() != index_dataset(flat, seed=4).fingerprint()
    assert index_dataset(flat, seed=3).images_fingerprint() == \
        index_dataset(flat, seed=4).images_fingerprint()
    assert here.fingerprint(("train", "val")) != here.fingerprint()
    write_image(copy.root / "train" / "red" / "0.jpg", COLOURS["red"], size=48)
    assert index_dataset(copy.root, seed=3).fingerprint() != here.fingerprint()
    (folder / "train" / "red" / "0.jpg").rename(folder / "train" / "blue" / "moved.jpg")
    assert here.fingerprint() != index_dataset(folder, seed=3).fingerprint()
    (folder / "train" / "blue" / "moved.jpg").unlink()
    assert here.fingerprint() != index_dataset(folder, seed=3).fingerprint()


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "CMYK", "I;16", "1", "LA"])
def test_any_image_mode_becomes_rgb(tmp_path, mode):
    fmt = {"CMYK": "JPEG"}.get(mode, "PNG")
    path = tmp_path / f"img.{fmt.lower()}"
    if mode == "I;16":
        arr = (np.linspace(0, 65535, 32 * 32).reshape(32, 32)).astype(np.uint16)
        Image.fromarray(arr).save(path)
    else:
        write_image(path, (120, 30, 200), mode=mode, fmt=fmt)
    img = load_rgb(path)
    assert img.mode == "RGB" and img.size == (32, 32)
    if mode == "I;16":  # the full 16-bit range maps onto 0..255, not clipped to white
        arr = np.asarray(img)
        assert arr.min() == 0 and arr.max() == 255


def test_rgba_transparency_becomes_white(tmp_path):
    path = tmp_path / "clear.png"
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(path)
    assert np.asarray(load_rgb(path)).min() == 255


@pytest.mark.parametrize("mode,key", [("RGB", (0, 0, 0)), ("L", 0), ("1", 0), ("P", 0)])
def test_a_colour_keyed_transparent_becomes_white(tmp_path, mode, key):
    """PNG's tRNS marks one colour transparent in an RGB, grey or 1-bit image, as PNG
    optimisers write logos whose alpha is all on or off: white, as alpha transparency is."""
    img = Image.new(mode, (4, 4), key)
    img.putpixel((0, 0), (255, 0, 0) if mode == "RGB" else 1 if mode in ("1", "P") else 200)
    if mode == "P":
        img.putpalette([0, 0, 0, 255, 0, 0])
    path = tmp_path / "keyed.png"
    img.save(path, transparency=key)
    with Image.open(path) as opened:
        assert opened.mode == mode and "transparency" in opened.info
    rgb = load_rgb(path)
    assert rgb.getpixel((1, 1)) == (255, 255, 255)
    if mode != "1":  # its other colour is white
        assert rgb.getpixel((0, 0)) != (255, 255, 255)


def test_a_16_bit_colour_key_is_left_as_stored(tmp_path):
    """A 16-bit RGB PNG opens as 8-bit RGB with its 16-bit key, which Pillow's conversion
    would match by its low byte: other pixels than the transparent ones turned white."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    key = (0x1234, 0x5678, 0x9ABC)
    lookalike = (0x34, 0x78, 0xBC)  # 8-bit pixels equal to the key's low bytes
    row = b"\0" + struct.pack(">3H", *key) + struct.pack(">3H", *(v << 8 for v in lookalike))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 16, 2, 0, 0, 0)) \
        + chunk(b"tRNS", struct.pack(">3H", *key)) + chunk(b"IDAT", zlib.compress(row)) \
        + chunk(b"IEND", b"")
    (tmp_path / "deep.png").write_bytes(png)
    assert load_rgb(tmp_path / "deep.png").getpixel((1, 0)) == lookalike


def test_bad_files_are_skipped_counted_and_named(folder, caplog):
    red = folder / "train" / "red"
    (red / "empty.jpg").write_bytes(b"")
    good = (red / "0.jpg").read_bytes()
    (red / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (red / "notes.jpg").write_text("not an image at all")
    (red / "random.png").write_bytes(np.random.default_rng(0).bytes(500))
    (red / ".DS_Store").write_bytes(b"\0\1junk")
    (red / "Thumbs.db").write_bytes(b"junk")
    (red / "readme.txt").write_text("ignored")
    write_image(red / "grey.png", (90, 90, 90), mode="L")  # usable after conversion
    with caplog.at_level(logging.WARNING):
        index = index_dataset(folder)
    reasons = dict((Path(p).name, r) for p, r in index.skipped)
    assert set(reasons) == {"empty.jpg", "truncated.jpg", "notes.jpg", "random.png"}
    assert reasons["empty.jpg"] == "empty file" and reasons["truncated.jpg"] == "truncated"
    assert index.skipped_files == 4
    assert any("grey.png" in p for p, _ in index.train + index.val)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "skipped 4" in warnings[1].getMessage()
    assert index.ignored == {".db": 1, ".txt": 1}  # counted apart: not images that failed


@pytest.mark.parametrize("breakage, message", [
    ("missing", "does not exist"),
    ("no classes", "has no class folders"),
    ("empty class", "class 'green' in the train split has no usable images"),
    ("all bad", "class 'green' in the train split has no usable images (12 undecodable"),
    ("class mismatch", "only in test: yellow"),
    ("class with a trailing space", "only in train: red; only in test: 'red '"),
    ("no test", "has train/ but no test/"),
    ("one training image per class", "too few images to set aside a validation split: 15 "
                                     "usable images in 3 classes"),
    ("two images per class", "give each class at least 3 images."),
])
def test_clear_errors(tmp_path, breakage, message):
    root = tmp_path / "d"
    if breakage == "one training image per class":  # before, it trained and then crashed
        make_folder(root, n_train=1)
    elif breakage == "two images per class":
        make_folder(root, layout="class folders", n_train=2, n_test=0)
    elif breakage == "no classes":
        (root / "train").mkdir(parents=True)
        (root / "test").mkdir()
    elif breakage not in ("missing", "one training image per class", "two images per class"):
        make_folder(root)
    if breakage == "empty class":
        for f in (root / "train" / "green").iterdir():
            f.unlink()
    if breakage == "all bad":
        for f in (root / "train" / "green").iterdir():
            f.write_bytes(b"")
    if breakage == "class mismatch":
        write_image(root / "test" / "yellow" / "0.jpg", (200, 200, 0))
    if breakage == "class with a trailing space":  # unquoted, the two names read the same
        (root / "test" / "red").rename(root / "test" / "red ")
    if breakage == "no test":
        import shutil
        shutil.rmtree(root / "test")
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as err:
        index_dataset(root)
    assert "\n" not in str(err.value)


def test_an_unreadable_data_folder_is_named_as_unreadable(folder, monkeypatch):
    """A data folder without read permission is a read that failed, not 'cannot write'."""
    from modules import dataset

    def forbidden(root):
        raise PermissionError(13, "Permission denied", str(root / "train"))
    monkeypatch.setattr(dataset, "find_splits", forbidden)
    with pytest.raises(UserError, match=r"^cannot read '.*train' in the data folder \(perm"):
        index_dataset(folder)
    monkeypatch.setattr(dataset.os, "access", lambda path, mode: False)
    with pytest.raises(UserError, match=r"^cannot read the data folder '.*data' \(permission"):
        index_dataset(folder)


def test_intel_source_uses_the_versioned_kagglehub_handle(tmp_path, monkeypatch):
    import kagglehub
    fixture = make_folder(tmp_path / "kaggle", layout="intel")
    asked = []
    monkeypatch.setattr(kagglehub, "dataset_download", lambda h, *a, **k: asked.append(h) or str(fixture))
    root, name = resolve_source("intel", None, tmp_path)
    assert (root, name) == (fixture, "intel")
    assert asked == ["puneet6060/intel-image-classification/versions/2"]
    assert index_dataset(root, name).layout == "intel"


def test_intel_offline_is_one_clear_line(tmp_path, monkeypatch):
    import kagglehub
    import requests

    def offline(*_, **__):
        raise requests.exceptions.ConnectionError("Failed to resolve 'api.kaggle.com'")
    monkeypatch.setattr(kagglehub, "dataset_download", offline)
    with pytest.raises(UserError) as err:
        resolve_source("intel", None, tmp_path)
    text = str(err.value)
    assert "cannot be reached" in text and "--data-dir" in text and "--dataset synthetic" in text
    assert "\n" not in text


@pytest.mark.parametrize("status", [401, 403, None])
def test_a_refused_kaggle_login_is_one_line_that_says_so(tmp_path, monkeypatch, status):
    import kagglehub
    import requests
    from kagglehub import exceptions

    def refused(*_, **__):
        if status is None:
            raise exceptions.UnauthenticatedError()
        response = requests.models.Response()
        response.status_code = status
        raise exceptions.KaggleApiHTTPError("Unauthorized", response=response)
    monkeypatch.setattr(kagglehub, "dataset_download", refused)
    with pytest.raises(UserError) as err:
        resolve_source("intel", None, tmp_path)
    text = str(err.value)
    assert text.startswith("Kaggle refused the login") and "KAGGLE_API_TOKEN" in text
    assert "cannot be reached" not in text and "\n" not in text
    assert (f"HTTP {status}" if status else "UnauthenticatedError") in text


@pytest.mark.parametrize("error, said", [
    (OSError(28, "No space left on device"), "no room to download the Intel dataset"),
    (ValueError("Invalid Kaggle credentials file at /root/.kaggle/kaggle.json"),
     "Kaggle's credentials file cannot be read"),
    (ValueError("Invalid header value b'Bearer KGAT_secret\\n'"),
     "the Kaggle token holds a line break or a space"),
    (type("BadZipFile", (Exception,), {})("File is not a zip file"),
     "the Intel dataset arrived damaged"),
])
def test_a_kaggle_failure_that_is_not_the_network_says_what_to_do(tmp_path, monkeypatch,
                                                                  error, said):
    """Each said "download it once with network access", which does not help with a full
    disk, a broken kaggle.json (read even before a complete cached copy), a token pasted with
    a line break (whose message also held the token) or a damaged archive."""
    import kagglehub
    monkeypatch.setattr(kagglehub, "dataset_download",
                        lambda *a, **k: (_ for _ in ()).throw(error))
    with pytest.raises(UserError) as err:
        resolve_source("intel", None, tmp_path)
    text = str(err.value)
    assert text.startswith(said) and "cannot be reached" not in text and "\n" not in text
    assert "KGAT_secret" not in text


def test_data_dir_overrides_dataset_and_names_it(folder, tmp_path):
    root, name = resolve_source("intel", folder, tmp_path)
    assert root == folder and name == "data"


def test_loaders_batch_at_the_requested_size(folder):
    config = TrainConfig(image_size=24, batch_size=8, num_workers=0)
    train, val, test = make_loaders(index_dataset(folder), config)
    x, y = next(iter(train))
    assert x.shape == (8, 3, 24, 24) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert abs(float(x.mean())) < 3  # normalised, not 0..255
    assert len(train.dataset) + len(val.dataset) + len(test.dataset) == 48


@pytest.mark.parametrize("cache_decoded", [False, True])
def test_a_training_split_no_larger_than_the_batch_is_one_short_batch(tmp_path, cache_decoded):
    """Only a short last batch beside full ones is dropped: three training images at
    --batch-size 8 are one batch of three, on the streaming and the cached path alike, not
    an empty loader ("the training split is empty")."""
    root = make_folder(tmp_path / "d", n_train=1, n_test=1)
    for c in COLOURS:
        write_image(root / "val" / c / "v.png", COLOURS[c])
    index = index_dataset(root)
    assert len(index.train) == 3
    config = TrainConfig(image_size=24, batch_size=8, num_workers=0, cache_decoded=cache_decoded)
    train, _, _ = make_loaders(index, config)
    assert isinstance(train, CachedLoader) == cache_decoded
    assert len(train) == 1 and [len(y) for _, y in train] == [3]


def test_loader_exposes_worker_knobs(folder):
    config = TrainConfig(image_size=24, batch_size=4, num_workers=2, pin_memory=True,
                         persistent_workers=True, prefetch_factor=3)
    train, _, _ = make_loaders(index_dataset(folder), config)
    assert (train.num_workers, train.pin_memory, train.persistent_workers,
            train.prefetch_factor) == (2, torch.cuda.is_available(), True, 3)
    assert next(iter(train))[0].shape == (4, 3, 24, 24)


def test_epoch_sampler_order_depends_only_on_seed_and_epoch():
    a, b = EpochSampler(50, seed=1), EpochSampler(50, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    b.set_epoch(4)
    assert list(a) != list(b)


def test_adjacent_seeds_do_not_share_shuffles_under_torchrun(monkeypatch):
    """DistributedSampler seeds with seed + epoch: --seed 42's second epoch was --seed 43's
    first."""
    from modules import dataset, distributed
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 0)

    def order(seed, epoch):
        sampler = dataset.train_sampler(100, seed)
        sampler.set_epoch(epoch)
        return list(sampler)
    assert order(42, 1) != order(43, 0) and order(42, 5) != order(44, 3)
    assert order(42, 1) == order(42, 1)


def test_the_quick_subset_checks_only_the_images_it_draws(tmp_path, monkeypatch, caplog):
    """--quick spent 17 of its 24 s on a 60,000-image folder checking images it then left out.
    It checks the drawn ones: the same index and fingerprint as checking all, said the same."""
    root = make_folder(tmp_path / "d", layout="class folders", n_train=30, n_test=0)
    (root / "red" / "notes.heic").write_bytes(b"x")
    checked = []
    check = dataset.check_image
    monkeypatch.setattr(dataset, "check_image",
                        lambda path, sizes=None: checked.append(path) or check(path, sizes))
    per_class = lambda n: {"train": 4, "val": 2, "test": 3}  # noqa: E731
    with caplog.at_level(logging.INFO, logger="modules.dataset"):
        quick = index_subset(root, "d", per_class, seed=5)
    said = [r.getMessage() for r in caplog.records]
    assert sorted(map(str, checked)) == sorted(p for p, _ in quick.train + quick.val + quick.test)
    assert len(checked) == 27 and quick.read_s > 0
    whole = subset(index_dataset(root, "d", seed=5), per_class(3), seed=5)
    assert (quick.train, quick.val, quick.test) == (whole.train, whole.val, whole.test)
    assert quick.fingerprint() == whole.fingerprint()
    assert sum("formats this does not read" in line for line in said) == 1


def test_an_undecodable_image_drawn_for_the_quick_subset_is_replaced_from_its_class(
        tmp_path, monkeypatch, caplog):
    """An undecodable image drawn gives way to another of its class, in an order of that class
    alone: every other class's draw stays, and the test images stay the same for every seed
    (a first version drew again from the checked folder, whose lists differ by the bad files:
    the test set then changed with the seed). Skipped files are counted and said once."""
    for split, n in (("train", 40), ("test", 30)):
        for c in COLOURS:
            for i in range(n):
                write_image(tmp_path / "d" / split / c / f"{i}.jpg", COLOURS[c])
    root = tmp_path / "d"
    per_class = lambda n: {"train": 8, "val": 4, "test": 6}  # noqa: E731
    clean = {seed: index_subset(root, "d", per_class, seed=seed) for seed in (1, 2)}
    bad = [p for p, label in clean[1].test if label == 0][:2] + [clean[1].train[0][0]]
    for path in bad:
        Path(path).write_bytes(b"")
    monkeypatch.setattr(dataset, "CHECK_SAID_FROM", 10)
    with caplog.at_level(logging.INFO, logger="modules.dataset"):
        quick = {seed: index_subset(root, "d", per_class, seed=seed) for seed in (1, 2)}
    said = [r.getMessage() for r in caplog.records]
    for seed in (1, 2):
        got, was = quick[seed], clean[seed]
        assert (len(got.train), len(got.val), len(got.test)) == (24, 12, 18)
        assert not {p for p, _ in got.train + got.val + got.test} & set(bad)
        assert sorted(p for p, _ in got.skipped) == sorted(p for p in bad if p in {
            q for q, _ in was.train + was.val + was.test})
        for split in ("train", "val", "test"):  # the classes without a bad image: as before
            assert [s for s in getattr(got, split) if s[1] != 0] == \
                [s for s in getattr(was, split) if s[1] != 0]
    assert quick[1].test == quick[2].test
    assert said.count("checking that the 54 images drawn decode ...") == 2
    assert sum(line.startswith("skipped ") for line in said) == 2
    for i in range(30):  # a class with no readable image left in a split
        (root / "test" / "red" / f"{i}.jpg").write_bytes(b"")
    with pytest.raises(UserError, match="class 'red' in the test split has no usable images"):
        index_subset(root, "d", per_class, seed=1)


def test_imbalanced_classes_are_said_with_what_one_class_alone_scores(tmp_path):
    """Where one class has most images, a high accuracy can be that class alone: said."""
    root = make_folder(tmp_path / "d", layout="class folders", n_train=6, n_test=0)
    assert index_dataset(root).imbalance() is None
    for i in range(6, 30):
        write_image(root / "red" / f"{i}.jpg", COLOURS["red"])
    line = index_dataset(root).imbalance()
    assert line.startswith("imbalanced classes: 'red' has 18 training images, 'blue' 4; a "
                           "model answering 'red' alone scores 75.0% on validation")
    # chance as the tuners take it: validation's largest class, which need not be train's
    for split, counts in (("train", {"red": 30, "green": 5, "blue": 5}),
                          ("val", {"red": 1, "green": 1, "blue": 12}),
                          ("test", {"red": 2, "green": 2, "blue": 2})):
        for c, n in counts.items():
            for i in range(n):
                write_image(tmp_path / "tv" / split / c / f"{i}.jpg", COLOURS[c])
    line = index_dataset(tmp_path / "tv").imbalance()
    assert "'red' has 30 training images" in line and "answering 'blue' alone scores 85.7%" in line


def test_subset_keeps_the_first_n_per_class(folder):
    index = subset(index_dataset(folder), {"train": 2, "test": 1})
    assert len(index.train) == 6 and len(index.test) == 3
    assert sorted({label for _, label in index.train}) == [0, 1, 2]


def test_synthetic_source_generates_intel_layout(tmp_path):
    root, name = resolve_source("synthetic", None, tmp_path, synthetic_per_class=(3, 2))
    index = index_dataset(root, name)
    assert name == "synthetic" and index.layout == "intel" and len(index.classes) == 6
    assert len(index.test) == 12


def test_folder_mistakes_a_new_user_makes_are_named(tmp_path, caplog):
    """A class named _other is a class; a class named train beside bus/ and car/ is not a
    split; class folders one level too deep get the --data-dir to pass; a class too small to
    reach validation or test says its accuracy is not measured."""
    def images(folder, n):
        for i in range(n):
            write_image(folder / f"{i}.jpg", COLOURS["red"])

    for name in ("cat", "_other", "__MACOSX"):
        images(tmp_path / "under" / name, 6)
    assert index_dataset(tmp_path / "under").classes == ["_other", "cat"]
    for name in ("bus", "car", "train"):
        images(tmp_path / "vehicles" / name, 6)
    assert index_dataset(tmp_path / "vehicles").classes == ["bus", "car", "train"]
    for name in ("cat", "dog"):
        images(tmp_path / "deep" / "animals" / name, 4)
    with pytest.raises(UserError, match=r"has one, 'animals'; if the folders in it \(cat, dog\) "
                                        r"are the classes, pass --data-dir '.*deep/animals'"):
        index_dataset(tmp_path / "deep")
    # an archive unpacked into a folder of its own name: its folders are splits, not classes
    for split in ("train", "test"):
        for name in ("cat", "dog"):
            images(tmp_path / "wrap" / "xray" / split / name, 4)
            images(tmp_path / "inner" / split / "images" / name, 4)
    with pytest.raises(UserError, match=r"has one, 'xray'; it holds split folders \(test, "
                                        r"train\): pass --data-dir '.*wrap/xray'\.$"):
        index_dataset(tmp_path / "wrap")
    make_folder(tmp_path / "kaggle" / "intel", layout="intel", n_train=3, n_test=2)
    with pytest.raises(UserError, match=r"has one, 'intel'; it holds split folders \(seg_test, "
                                        r"seg_train\): pass --data-dir '.*kaggle/intel'\.$"):
        index_dataset(tmp_path / "kaggle")
    with pytest.raises(UserError, match=r"has one, 'images'; '.*inner/train' holds one folder, "
                                        r"'images': if the folders in it \(cat, dog\) are the "
                                        r"classes, move them up one level in each split\.$"):
        index_dataset(tmp_path / "inner")
    images(tmp_path / "tiny" / "cat", 10)
    images(tmp_path / "tiny" / "dog", 1)
    with caplog.at_level(logging.WARNING):
        index = index_dataset(tmp_path / "tiny")
    assert 1 not in {y for _, y in index.test}
    assert "class 'dog' has no test images" in caplog.text


def test_class_names_in_other_unicode_forms_are_one_class_per_split(tmp_path):
    """A test/ folder written on macOS names its classes decomposed (NFD): the run was refused
    with "only in train: café; only in test: café". Two folders of one split whose names
    differ only so would hide one another's images."""
    import unicodedata
    composed, decomposed = (unicodedata.normalize(form, "café") for form in ("NFC", "NFD"))
    root = tmp_path / "forms"
    for split, name in (("train", composed), ("test", decomposed)):
        for cls in (name, "tea"):
            for i in range(4):
                write_image(root / split / cls / f"{i}.jpg", COLOURS["red"])
    index = index_dataset(root)
    assert index.classes == [composed, "tea"] and len(index.test) == 8
    for i in range(4):
        write_image(root / "train" / decomposed / f"{i}.jpg", COLOURS["red"])
    with pytest.raises(UserError, match=r"has two class folders named 'café' \(the same "
                                        r"letters in other Unicode forms\); rename one"):
        index_dataset(root)


def test_split_folders_among_classes_are_refused_or_named(tmp_path, caplog):
    """A test/ or val/ beside class folders would train as one more class mixing them all; a
    second folder of one split (training/ beside train/) would be silently left unread."""
    def classes(root, names, n=4):
        for name in names:
            for i in range(n):
                write_image(root / name / f"{i}.jpg", COLOURS["red"])
        return root

    beside = classes(classes(tmp_path / "beside", ["cat", "dog"]) / "test", ["cat", "dog"]).parent
    with pytest.raises(UserError, match=r"holds test/ beside cat/, dog/: split folders are not"):
        index_dataset(beside)
    root = tmp_path / "extra"
    for split in ("train", "val"):
        classes(root / split, ["cat", "dog"])
    classes(root / "unlabeled", ["a"])
    with pytest.raises(UserError, match=r"has train/ but no test/ folder"):
        index_dataset(root)
    # train/ of class folders beside loose unlabelled images in pred/, no test/: it trained
    # "pred vs train" as two classes
    root = classes(tmp_path / "pred", ["train"], n=0)
    classes(root / "train", ["cat", "dog", "eel"])
    classes(root, ["pred"])
    with pytest.raises(UserError, match=r"has train/ but no test/ folder"):
        index_dataset(root)
    root = tmp_path / "cased"
    for split in ("Train", "Val", "pred"):
        classes(root / split, ["cat", "dog"])
    with pytest.raises(UserError, match=r"holds Val/ beside Train/, pred/"):
        index_dataset(root)
    root = make_folder(tmp_path / "twice", n_train=4, n_test=2)
    make_folder(root / "training", n_train=1, n_test=0)
    with caplog.at_level(logging.WARNING):
        index_dataset(root)
    assert "training/ beside train/ is not used" in caplog.text


def test_a_folder_that_cannot_be_listed_is_an_error_not_fewer_images(folder, monkeypatch):
    import errno
    import os

    from modules import dataset
    listing = os.scandir
    for error, message in ((PermissionError(errno.EACCES, "Permission denied"),
                            r"^cannot read '.*phone' in the data folder \(permission denied"),
                           (OSError(errno.EIO, "Input/output error"),
                            r"^cannot list '.*phone' in the data folder \(Input/output error")):
        def scandir(path, error=error):
            if str(path).endswith("phone"):
                error.filename = str(path)
                raise error
            return listing(path)
        write_image(folder / "train" / "red" / "phone" / "0.jpg", COLOURS["red"])
        monkeypatch.setattr(dataset.os, "scandir", scandir)
        with pytest.raises(UserError, match=message):
            index_dataset(folder)


def test_a_class_of_undecodable_files_in_subfolders_says_how_many(folder):
    for f in (folder / "train" / "green").iterdir():
        f.unlink()
    for i in range(3):
        (folder / "train" / "green" / "2023" / f"{i}.jpg").parent.mkdir(exist_ok=True)
        (folder / "train" / "green" / "2023" / f"{i}.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(UserError, match=r"'green' in the train split has no usable images "
                                        r"\(3 undecodable files skipped\)"):
        index_dataset(folder)


def test_one_wrapping_folder_with_a_name_that_is_not_utf8_gets_the_one_line(tmp_path):
    import os
    root = tmp_path / "data"
    wrapper = os.path.join(os.fsencode(root), b"Fotos_caf\xe9")
    for name in ("cat", "dog"):
        for i in range(3):
            write_image(Path(os.fsdecode(os.path.join(wrapper, name.encode()))) / f"{i}.jpg",
                        COLOURS["red"])
    with pytest.raises(UserError, match=r"has one, 'Fotos_caf\\\\xe9'; if the folders in it "
                                        r"\(cat, dog\) are the classes, pass --data-dir .*, "
                                        r"renamed: its name is not UTF-8\.$"):
        index_dataset(root)


def test_files_that_are_not_read_are_counted_and_named(tmp_path, caplog):
    """A .jpe is a JPEG and is read; an iPhone's .heic, a notes file and images dropped beside
    the class folders are not, and the user is told how many and why, not left to wonder."""
    root = make_folder(tmp_path / "data", "train/test", n_train=6, n_test=3)
    write_image(root / "train" / "red" / "extra.jpe", COLOURS["red"], fmt="JPEG")
    (root / "train" / "red" / "IMG_0001.heic").write_bytes(b"\0" * 64)
    (root / "train" / "red" / "IMG_0002.HEIC").write_bytes(b"\0" * 64)
    (root / "test" / "blue" / "notes.txt").write_text("labels checked")
    for i in range(2):
        write_image(root / "train" / f"loose{i}.jpg", COLOURS["green"])
    with caplog.at_level(logging.WARNING):
        index = index_dataset(root)
    assert any(p.endswith("extra.jpe") for p, _ in index.train + index.val)
    assert index.ignored == {".heic": 2, ".txt": 1, "images outside a class folder": 2}
    assert "5 other files ignored" in index.summary()
    assert "ignored 2 image(s) outside the class folders" in caplog.text
    assert "ignored 3 file(s) of formats this does not read (.heic: 2, .txt: 1); it reads" \
        in caplog.text


def test_a_phone_photo_is_used_upright_on_every_path(tmp_path):
    """A portrait photo stored sideways with EXIF orientation 6 (rotate 90 degrees clockwise
    to view): the baseline's decode, the fast path's cache and the sample grid see it upright."""
    from modules.fastdata import decode_resized
    stored = np.zeros((20, 40, 3), dtype=np.uint8)   # 40 wide, 20 high: left red, right blue
    stored[:, :20] = (255, 0, 0)
    stored[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "portrait.jpg"
    Image.fromarray(stored).save(path, exif=exif.tobytes(), quality=95)
    img = load_rgb(path)
    assert img.size == (20, 40)  # upright: 20 wide, 40 high, red on top
    top, bottom = np.asarray(img)[5, 10], np.asarray(img)[35, 10]
    assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0]
    cached = decode_resized(str(path), 32)
    assert cached[4, 16, 0] > 200 > cached[4, 16, 2] and cached[28, 16, 2] > 200 > cached[28, 16, 0]


def test_a_photo_with_a_malformed_exif_block_is_used_upright(tmp_path):
    """PIL decodes such a photo but raises rewriting its EXIF when turning it upright: it was
    listed as good, then stopped every epoch and every cache build."""
    import io

    from PIL import ImageOps

    from modules.fastdata import decode_resized
    exif = Image.Exif()
    exif[0x0112], exif[0x010F], exif[0x0110], exif[0x0131] = 6, "Canon", "EOS", "fw 1.0"
    exif.get_ifd(0x8769)[0x9003] = "2020:01:01 00:00:00"
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (16, 24, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG", exif=exif)
    data = bytearray(buffer.getvalue())
    data[data.find(b"Exif\0\0") + 53] = 23  # one byte of a tag's value offset, as found in the wild
    root = make_folder(tmp_path / "data", n_train=4, n_test=2)
    path = root / "train" / "red" / "0.jpg"
    path.write_bytes(bytes(data))
    with Image.open(path) as img:
        img.load()
        with pytest.raises(Exception):  # noqa: B017 - the fault this guards against, in PIL
            ImageOps.exif_transpose(img)
    index = index_dataset(root)
    assert not index.skipped and any(p == str(path) for p, _ in index.train + index.val)
    assert load_rgb(path).size == (16, 24)  # its orientation tag read: upright
    assert decode_resized(str(path), 32).shape[:2] == (32, 32)


def test_a_wide_image_is_cropped_in_its_squashed_square_as_it_is_tested(monkeypatch):
    """eval_transform, predict and the decoded cache squash every image to a square: the
    training crop's aspect ratio is drawn there too (3/4 to 4/3 of the square, so 1.33 to
    2.37 of a 16:9 image's own pixels), and a square image is cropped as before."""
    from PIL import Image
    from torchvision import transforms as T

    from modules import dataset as dataset_module
    crop = dataset_module.SquareRandomResizedCrop(32, scale=(0.6, 1.0), antialias=True)
    seen = []
    real = dataset_module.TF.resized_crop

    def spy(img, top, left, height, width, *a, **k):
        seen.append(width / height)
        return real(img, top, left, height, width, *a, **k)
    monkeypatch.setattr(dataset_module.TF, "resized_crop", spy)
    for _ in range(300):
        assert crop(Image.new("RGB", (160, 90))).size == (32, 32)
    assert 1.3 < min(seen) and 2.0 < max(seen) < 2.4
    monkeypatch.undo()
    square = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 50, 3), np.uint8))
    torch.manual_seed(0)
    ours = np.array(crop(square))
    torch.manual_seed(0)
    assert np.array_equal(ours, np.array(T.RandomResizedCrop(32, scale=(0.6, 1.0),
                                                              antialias=True)(square)))


def test_images_beside_the_split_folders_are_counted_too(tmp_path, caplog):
    """Images dropped beside train/ and test/, or in Intel's outer seg_train/, are in no split:
    counted and named, as images beside the class folders are."""
    root = make_folder(tmp_path / "tt", "train/test", n_train=6, n_test=3)
    for i in range(2):
        write_image(root / f"unsorted{i}.png", COLOURS["green"])
    with caplog.at_level(logging.WARNING):
        assert index_dataset(root).ignored == {"images outside a class folder": 2}
    assert "ignored 2 image(s) outside the class folders" in caplog.text
    intel = make_folder(tmp_path / "intel", "intel", n_train=6, n_test=3)
    write_image(intel / "seg_train" / "stray.jpg", COLOURS["red"], seed=0)
    write_image(intel / "seg_train" / "seg_train" / "stray2.jpg", COLOURS["red"], seed=1)
    assert index_dataset(intel).ignored == {"images outside a class folder": 2}


def test_a_class_named_with_double_underscores_is_a_class(tmp_path):
    """Only the folders tools leave (__MACOSX, __pycache__) are not classes: a detection-style
    __background__ class is trained, not dropped without a word."""
    root = make_folder(tmp_path / "data", "train/test", n_train=6, n_test=3)
    for split, n in (("train", 6), ("test", 3)):
        for i in range(n):
            write_image(root / split / "__background__" / f"{i}.png", COLOURS["green"])
        write_image(root / split / "__MACOSX" / "._0.png", COLOURS["green"], seed=0)
    assert "__background__" in index_dataset(root).classes
    assert "__MACOSX" not in index_dataset(root).classes


def test_a_class_of_only_unread_formats_says_which(tmp_path):
    """A class whose files are all of a format this does not read (an iPhone's .HEIC) is
    refused, and the one line says what the folder holds and what is read."""
    root = make_folder(tmp_path / "data", "train/test", n_train=6, n_test=3)
    for i in range(3):
        (root / "train" / "phone" / f"IMG_{i}.HEIC").parent.mkdir(parents=True, exist_ok=True)
        (root / "train" / "phone" / f"IMG_{i}.HEIC").write_bytes(b"\0" * 64)
    with pytest.raises(UserError, match=r"class 'phone' in the train split has no usable images "
                                        r"\(it holds 3 \.heic; this reads .*\.jpg"):
        index_dataset(root)


def _copy_pairs(index):
    """(split, path) pairs of images whose bytes another split's image holds."""
    held = {}
    for split in ("train", "val", "test"):
        for path, _ in getattr(index, split):
            held.setdefault(Path(path).read_bytes(), set()).add(split)
    return [splits for splits in held.values() if len(splits) > 1]


def test_copies_of_held_out_images_are_left_out_of_training(tmp_path, caplog):
    """Each image saved twice under two names: the split put 72 of 120 test images' copies
    in training, and a model that memorised random labels tested at 78% (chance 33%)."""
    root = tmp_path / "dups"
    for c, colour in COLOURS.items():
        for i in range(20):
            image = write_image(root / c / f"{i}.png", colour, seed=100 + i)
            (root / c / f"{i} (1).png").write_bytes(image.read_bytes())
    with caplog.at_level(logging.WARNING, logger="modules.dataset"):
        index = index_dataset(root, "dups", seed=3)
    assert _copy_pairs(index) == []
    assert index.copies and index.n_images() + len(index.copies) == 120
    kept = {p for split in ("val", "test") for p, _ in getattr(index, split)}
    assert all(k in kept for _, k in index.copies)
    said = [r.getMessage() for r in caplog.records if "byte-identical" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("left out ") and " = " in said[0]
    assert f"{len(index.copies)} copies of held-out images left out" in index.summary()
    import scenario  # the run's folder lists every copy, and run.log says so
    lines = scenario.data_record(index, tmp_path / "run")
    assert lines[-1] == f"{len(index.copies)} copies of validation or test images left out: " \
        "listed in left_out_copies.txt"
    listed = (tmp_path / "run" / "left_out_copies.txt").read_text().splitlines()
    assert listed == index.copy_lines() and listed[0].count("\t") == 1
    # --quick's draw checks only what it draws, and leaves its copies out the same way
    quick = index_subset(root, "dups", lambda n: {"train": 20, "val": 5, "test": 8}, seed=3)
    assert _copy_pairs(quick) == [] and quick.copies


def test_a_test_folder_of_training_copies_keeps_the_test_images(tmp_path):
    """The user's test/ split stays as given; the training copies of its images are left
    out, and a class whose every training image is one is refused in one line."""
    root = make_folder(tmp_path / "tt", n_train=6, n_test=3)
    for c in COLOURS:
        (root / "test" / c / "copied.jpg").write_bytes((root / "train" / c / "0.jpg").read_bytes())
    index = index_dataset(root, "tt")
    assert len(index.test) == 12 and _copy_pairs(index) == []
    assert sorted(Path(p).parts[-3:] for p, _ in index.copies) == [
        ("train", c, "0.jpg") for c in sorted(COLOURS)]
    for path in (root / "train" / "red").iterdir():
        (root / "test" / "red" / f"c{path.name}").write_bytes(path.read_bytes())
    with pytest.raises(UserError, match="every training image of class 'red' is a "
                                        "byte-identical copy"):
        index_dataset(root, "tt")


@pytest.mark.parametrize("quick", [False, True])
def test_a_val_folder_copied_from_test_is_refused_in_one_line(tmp_path, quick):
    """val/ made by `cp -r test val`: leaving its copies out emptied validation; a full run
    then blamed too few training images, and --quick trained on, validated at nan and ended
    in a TypeError."""
    import shutil
    root = make_folder(tmp_path / "v", n_train=12, n_test=4)
    shutil.copytree(root / "test" / "red", root / "val" / "red")
    for c in ("green", "blue"):
        for i in range(3):
            write_image(root / "val" / c / f"v{i}.jpg", COLOURS[c])
    with pytest.raises(UserError, match=r"every validation image of class 'red' is a "
                                        r"byte-identical copy of a test image; .* if a val "
                                        r"folder copies the test folder, remove it"):
        if quick:
            index_subset(root, "v", lambda n: {"train": 10, "val": 3, "test": 4})
        else:
            index_dataset(root, "v")


def test_an_image_lost_during_training_says_why_and_how_to_go_on(tmp_path, monkeypatch):
    """An image removed mid-run names the reason and both ways on; a drive's read error is
    the drive's one line, which --resume continues, not a reason to index again."""
    import errno

    from modules.files import ReadFailed
    gone = tmp_path / "a.png"
    data = dataset.ImageListDataset([(str(gone), 0)], transform=lambda img: img)
    with pytest.raises(UserError, match=r"became unreadable during training \(No such file "
                       r"or directory\): restore it and rerun with --resume, or rerun without"):
        data[0]

    gone.write_bytes(b"not an image")  # PIL's message names the file: not twice
    with pytest.raises(UserError, match=r"became unreadable during training \(cannot identify "
                       r"image file\): restore"):
        data[0]

    def drive_failed(path):
        raise OSError(errno.EIO, "Input/output error", path)
    monkeypatch.setattr(dataset, "load_rgb", drive_failed)
    with pytest.raises(ReadFailed, match=r"^could not read or write '.*a\.png' \(Input/output "
                       r"error\): the disk or network drive failed; .*--resume"):
        data[0]


def test_a_broken_link_to_a_class_folder_is_one_line_not_a_class_dropped(tmp_path):
    """A class folder linked in from a drive that is not mounted is neither a folder nor a
    file: it was left out without a word, and the run trained on the other classes."""
    root = make_folder(tmp_path / "d", layout="class folders")
    (root / "teal").symlink_to(tmp_path / "not-mounted" / "teal")
    with pytest.raises(UserError, match=r"'.*teal' is a link to '.*not-mounted/teal', which "
                                        r"does not exist") as err:
        index_dataset(root)
    assert "\n" not in str(err.value)


def test_a_broken_link_to_an_image_is_skipped_as_such(folder):
    (folder / "train" / "red" / "gone.jpg").symlink_to(folder / "nowhere.jpg")
    index = index_dataset(folder)
    assert ("a link to a missing file" in dict((Path(p).name, r) for p, r in index.skipped)
            ["gone.jpg"])


def test_split_folders_inside_class_folders_are_one_line(tmp_path):
    """<class>/train/ and <class>/test/ were read as one class each: the images the user held
    out were trained on, and another test split drawn, without a word."""
    for name in ("cat", "dog"):
        for split in ("train", "test"):
            for i in range(3):
                write_image(tmp_path / "d" / name / split / f"{i}.png", (i * 40, 0, 0))
    with pytest.raises(UserError, match=r"class folders in .* hold split folders \(cat/test/ "
                                        r"\.\.\.\): this reads train/<class>/") as err:
        index_dataset(tmp_path / "d")
    assert "\n" not in str(err.value)
    # a class folder with subfolders of its own is read as before
    (tmp_path / "d" / "dog" / "train").rename(tmp_path / "d" / "dog" / "puppies")
    (tmp_path / "d" / "dog" / "test").rename(tmp_path / "d" / "dog" / "adults")
    assert index_dataset(tmp_path / "d").classes == ["cat", "dog"]
