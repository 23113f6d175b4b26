"""What the toolkit trusts (issue 18): storage URLs never shown with their secrets, ImageNet
weights checked by hash, dependency floors past known advisories, file modes, symlinked data
folders, deep-colour images and model files that claim too much."""
from __future__ import annotations

import email.message
import errno
import io
import logging
import os
import pickle
import shutil
import signal
import sys
import time
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from packaging.requirements import Requirement
from PIL import Image

from conftest import make_folder
from modules import models
from modules.config import TrainConfig, UserError
from modules.dataset import index_dataset, load_rgb, to_rgb
from modules.files import atomic_torch_save, atomic_write_text, share_file
from modules.models import build_model
from modules.profiler import SystemSampler
from modules.storage import without_password
from modules.utility import load_model, save_model
from optuna_optimizer import OptunaTuner

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (a symlink loop once made the scan run without end)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------- storage URLs

@pytest.mark.parametrize("url, shown", [
    ("postgresql+psycopg://user:pw@host:5432/db", "postgresql+psycopg://host:5432/db"),
    ("postgresql://host/db?password=secret", "postgresql://host/db"),
    ("postgresql://user@host/db?sslmode=require&password=secret", "postgresql://host/db"),
    ("postgresql://u:p@ss@host/db", "postgresql://host/db"),  # the last "@" ends the userinfo
    ("postgresql+psycopg://u:s3cret@127.0.0.1:1/db?password=s3cret",
     "postgresql+psycopg://127.0.0.1:1/db"),
    ("mysql://u:p/w@[::1]:3306/db", "mysql://[::1]:3306/db"),
    ("postgresql://u:pw@/db?host=/var/run/postgresql", "postgresql:///db"),
    ("sqlite:///path/optuna.db", "sqlite:///path/optuna.db"),
    ("sqlite:////abs/o@k/optuna.db?mode=ro", "sqlite:////abs/o@k/optuna.db"),
    ("sqlite+pysqlcipher://:passphrase@/optuna.db", "sqlite+pysqlcipher:///optuna.db"),
])
def test_storage_url_shows_driver_host_port_and_database_only(url, shown):
    assert without_password(url) == shown


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:pw@host:123456/db", "postgresql://<unparseable>"),  # no such port
    # Two readings ("host/db" and "ss"): either could show part of a secret.
    ("postgresql://u:pw@host/db?password=p@ss", "postgresql://<unparseable>"),
    ("postgresql://u:12?x@host/db", "postgresql://<unparseable>"),
    ("u:pw@host/db", "<unparseable>"),
    ("postgresql:u:pw@host/db", "<unparseable>"),
])
def test_an_unparseable_url_shows_only_its_driver(url, shown):
    assert without_password(url) == shown


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return index_dataset(make_folder(tmp_path_factory.mktemp("data"), n_train=4, n_test=2))


BASE = TrainConfig(model="resnet18", weights="none", image_size=24, epochs=1, batch_size=8,
                   scheduler="none", device="cpu", progress=False, seed=0)


def test_storage_that_cannot_be_opened_is_reported_without_the_password(index, tmp_path):
    url = "postgresql+psycopg://u:s3cret@127.0.0.1:1/db?password=s3cret"  # nothing listens
    start = time.perf_counter()
    with pytest.raises(UserError) as err:
        OptunaTuner(index, BASE, output_dir=tmp_path, storage=url)
    assert time.perf_counter() - start < 10
    message = str(err.value)
    assert "s3cret" not in message and "u:" not in message and "\n" not in message
    assert "127.0.0.1:1/db" in message


def test_the_drivers_error_does_not_quote_a_password_holding_an_at_sign(index, tmp_path):
    with pytest.raises(UserError) as err:
        OptunaTuner(index, BASE, output_dir=tmp_path,
                    storage="postgresql+psycopg://u:pw@Secret9@127.0.0.1:1/db")
    assert "Secret9" not in str(err.value)


# ----------------------------------------------------------------------------- dependencies

def _requirements() -> dict[str, Requirement]:
    reqs = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split(" #")[0].split("#")[0].strip() if not line.startswith("#") else ""
        if line:
            req = Requirement(line)
            reqs[req.name.lower()] = req
    return reqs


@pytest.mark.parametrize("name, refused, accepted", [
    # weights_only unpickler memory corruption (CVE-2026-24747); Colab ships 2.11.
    ("torch", ["2.5.1", "2.9.1"], ["2.10.0", "2.11.0+cu128", "2.14.1"]),
    ("torchvision", ["0.24.0"], ["0.25.0", "0.26.0+cu128"]),
    ("pillow", ["10.0.0", "10.2.0"], ["10.3.0", "11.3.0", "12.3.0"]),
    ("kagglehub", ["0.2.5", "0.3.13"], ["0.4.0", "1.0.2"]),  # KAGGLE_API_TOKEN from 0.4.0
    ("ipywidgets", ["7.5.0"], ["7.7.1", "8.1.5"]),  # Colab's 7.7.1 is kept
    ("nvidia-ml-py", ["11.525.0"], ["12.535.77", "13.610.43"]),
    # importances failed on trials of one value and without scikit-learn before 5.0 (fANOVA)
    ("optuna", ["3.5.0", "4.9.0"], ["5.0.0", "5.1.0"]),
])
def test_requirement_floors_refuse_vulnerable_versions_and_keep_colabs(name, refused, accepted):
    spec = _requirements()[name].specifier
    assert not any(spec.contains(v, prereleases=True) for v in refused)
    assert all(spec.contains(v, prereleases=True) for v in accepted)


def test_nvml_is_required_where_nvidia_gpus_are():
    marker = _requirements()["nvidia-ml-py"].marker
    assert marker.evaluate({"sys_platform": "linux"})
    assert not marker.evaluate({"sys_platform": "darwin"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_sampler_watching_a_gpu_on_a_machine_without_one_reads_none():
    pytest.importorskip("pynvml")  # installed: nvmlInit raises for want of a driver
    with SystemSampler(interval_s=0.2, cuda_device=0) as sampler:
        time.sleep(0.3)
    summary = sampler.summary()
    assert summary["gpu_util_pct"] is None and summary["gpu_mem_peak_mb"] is None


# ----------------------------------------------------------------------------- ImageNet weights

def test_imagenet_weights_are_hash_checked_and_read_without_code(monkeypatch):
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    reference = torchvision.models.squeezenet1_1(weights=None).state_dict()
    calls = []

    def load_state_dict_from_url(url, *args, **kwargs):
        calls.append(kwargs)
        return reference
    # torchvision's Weights.get_state_dict calls its own import of torch.hub's function.
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url",
                        load_state_dict_from_url)
    model = build_model("squeezenet1_1", 6, "imagenet")
    assert calls and calls[0].get("check_hash") is True and calls[0].get("weights_only") is True
    torch.testing.assert_close(model.features[0].weight, reference["features.0.weight"])


def test_a_tampered_download_is_a_one_line_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    tampered = io.BytesIO()
    torch.save(torchvision.models.squeezenet1_1(weights=None).state_dict(), tampered)

    class Response(io.BytesIO):  # what urlopen returns, serving the tampered bytes
        def info(self):
            headers = email.message.Message()
            headers["Content-Length"] = str(len(self.getvalue()))
            return headers
    monkeypatch.setattr(torch.hub, "urlopen", lambda *_, **__: Response(tampered.getvalue()))
    with pytest.raises(UserError, match="do not match their published hash") as err:
        build_model("squeezenet1_1", 6, "imagenet")
    assert "\n" not in str(err.value)
    cache = tmp_path / "hub" / "checkpoints"
    assert not any(cache.iterdir())  # nothing kept: the next run downloads again
    assert "squeezenet1_1" not in models._UNREACHABLE


# ----------------------------------------------------------------------------- file modes

@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_give_the_mode_open_gives(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        atomic_write_text("{}", tmp_path / "results.json")
        atomic_torch_save({"x": torch.zeros(2)}, tmp_path / "ckpt.pt")
        atomic_write_text("[]", tmp_path / "results.json")  # replacing keeps the rule
    finally:
        os.umask(previous)
    for name in ("results.json", "ckpt.pt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode
    assert not list(tmp_path.glob(".*.tmp"))


def test_ctrl_c_inside_torch_save_is_an_interrupt_not_a_corrupt_file(tmp_path, monkeypatch):
    """The notebook's Stop during a checkpoint's save: torch.save's writer turns the
    KeyboardInterrupt into RuntimeError("unexpected pos"), which read as a broken file in a
    traceback. It stays an interrupt (the run's resume hint), the checkpoint before it whole."""
    from modules import files
    path = tmp_path / "baseline.pt"
    atomic_torch_save({"epoch": 1}, path)
    before = path.read_bytes()
    real_fdopen = os.fdopen

    class Interrupted(io.RawIOBase):
        def __init__(self, f):
            self.f, self.calls = f, 0

        def writable(self):
            return True

        def write(self, data):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return self.f.write(data)

        def close(self):
            self.f.close()
            super().close()
    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: Interrupted(real_fdopen(fd, mode)))
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"epoch": 2, "w": torch.zeros(10_000)}, path)
    assert path.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))
    monkeypatch.undo()
    # an interrupt met while a write error was handled is the interrupt; an error met while
    # an interrupt was handled is that error, as it was
    def failing(first, then):
        def write(f):
            try:
                raise first
            except BaseException:
                raise then  # noqa: B904 (the context is the point)
        return write
    with pytest.raises(KeyboardInterrupt):
        files._atomic_write(path, failing(OSError(errno.EIO, "Input/output error"),
                                          KeyboardInterrupt()))
    with pytest.raises(TypeError, match="a bug"):
        files._atomic_write(path, failing(KeyboardInterrupt(), TypeError("a bug")))
    assert path.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))


def test_a_shared_file_is_a_hard_link_or_else_a_whole_copy(tmp_path, monkeypatch):
    source = tmp_path / "resolution.pt"
    atomic_torch_save({"x": torch.arange(4)}, source)
    share_file(source, tmp_path / "hpo.pt")
    assert (tmp_path / "hpo.pt").stat().st_ino == source.stat().st_ino
    # a file system without hard links (Google Drive's folder in Colab): a copy
    monkeypatch.setattr(os, "link", lambda *_: (_ for _ in ()).throw(OSError("no links")))
    share_file(source, tmp_path / "copy.pt")
    assert (tmp_path / "copy.pt").stat().st_ino != source.stat().st_ino
    assert (tmp_path / "copy.pt").read_bytes() == source.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.pt", "hpo.pt", "resolution.pt"]


# ----------------------------------------------------------------------------- linked data

@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="POSIX links and alarms")
def test_symlink_loops_in_a_data_folder_list_each_image_once(tmp_path):
    root = make_folder(tmp_path / "d", n_train=6, n_test=3)
    red = root / "train" / "red"
    (red / "self").symlink_to(".")                      # the class folder itself
    (red / "up").symlink_to("..")                       # its split folder, other classes within
    (red / "twin").symlink_to(red)                      # the same class folder again
    (red / "sub").mkdir()
    (red / "sub" / "top").symlink_to(root)              # the data root: train and test
    outside = make_folder(tmp_path / "more", n_train=2, n_test=0, classes=("red",))
    (red / "linked").symlink_to(outside / "train" / "red")  # a folder linked in: followed
    with deadline(20):
        index = index_dataset(root, seed=0)
    samples = index.train + index.val + index.test
    real = [os.path.realpath(p) for p, _ in samples]
    assert len(real) == len(set(real)) == 3 * 9 + 2
    label = {os.path.realpath(p): c for p, c in samples}
    red_index = index.classes.index("red")
    assert all(label[os.path.realpath(p)] == red_index for p in outside.rglob("*.jpg"))
    for split in ("train", "test"):
        for colour in ("blue", "green"):
            for path in (root / split / colour).glob("*.jpg"):
                assert label[os.path.realpath(path)] == index.classes.index(colour)


@pytest.mark.skipif(os.name == "nt", reason="POSIX links")
def test_a_hard_linked_image_is_listed_once_where_first_found(tmp_path, caplog):
    """A hard link is a second name of the same file (DVC's hardlink cache, `cp -al`): listed
    again, one image trained on was tested on as well. A plain copy is another file, tested
    on; the training image it copies is left out (leave_out_copies)."""
    root = make_folder(tmp_path / "d", n_train=4, n_test=2)
    first = sorted((root / "train" / "red").iterdir())[0]
    os.link(first, root / "test" / "red" / "hardlink.jpg")
    (root / "test" / "blue" / "symlink.jpg").symlink_to(sorted((root / "train" / "blue").iterdir())[0])
    shutil.copy(first, root / "test" / "green" / "copy.jpg")
    with caplog.at_level(logging.WARNING, logger="modules.dataset"):
        index = index_dataset(root, seed=0)
    listed = [str(p) for p, _ in index.train + index.val + index.test]
    assert len(listed) == 3 * 6 and str(first) not in listed
    assert [(p, Path(kept).name) for p, kept in index.copies] == [(str(first), "copy.jpg")]
    names = {Path(p).name for p, _ in index.test}
    assert "hardlink.jpg" not in names and "symlink.jpg" not in names and "copy.jpg" in names
    assert "reaches 2 image file(s) a second time through links" in caplog.text


@pytest.mark.skipif(os.name == "nt", reason="POSIX links")
def test_a_test_split_linked_to_train_is_refused_not_leaked(tmp_path):
    root = make_folder(tmp_path / "d", n_train=4, n_test=2)
    for colour in ("blue", "green", "red"):
        for path in (root / "test" / colour).iterdir():
            path.unlink()
        (root / "test" / colour).rmdir()
        (root / "test" / colour).symlink_to(root / "train" / colour)
    with pytest.raises(UserError, match="already counted elsewhere through links"):
        index_dataset(root, seed=0)


# ----------------------------------------------------------------------------- deep colour

def _old_to_8bit(arr: np.ndarray) -> np.ndarray:
    """The earlier conversion, whose scaling stays: min..max stretched to 0..255, truncated."""
    arr = arr.astype(np.float64)
    lo, hi = float(arr.min()), float(arr.max())
    return ((arr - lo) * (255.0 / (hi - lo))).astype(np.uint8)


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_deep_colour_images_scale_as_before(dtype):
    gradient = (np.arange(37 * 53).reshape(37, 53) * 7 - 300).astype(dtype)
    img = Image.fromarray(gradient)
    assert img.mode in ("I", "F")
    rgb = np.asarray(to_rgb(img))
    assert rgb.shape == (37, 53, 3)
    for channel in range(3):
        np.testing.assert_array_equal(rgb[..., channel], _old_to_8bit(gradient))


@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_16_bit_images_read_as_8_bits_of_the_same_scene(tmp_path, mode):
    """16-bit values scale by the format's range, not the image's own: a flat grey stays that
    grey (it read black), a faint one is not stretched to full contrast. Older Pillows open a
    16-bit PNG as I."""
    levels = np.array([[155, 156], [0, 255]], dtype=np.uint16)
    img = Image.fromarray(levels * 257)
    if mode == "I":
        img = img.convert("I")
    assert img.mode == mode
    np.testing.assert_array_equal(np.asarray(to_rgb(img))[..., 0], levels)
    flat = Image.fromarray(np.full((3, 3), 155 * 257, dtype=np.uint16))
    path = tmp_path / "flat16.png"
    flat.save(path)
    Image.new("L", (3, 3), 155).save(tmp_path / "flat8.png")
    assert load_rgb(path).getpixel((1, 1)) == load_rgb(tmp_path / "flat8.png").getpixel((1, 1)) \
        == (155, 155, 155)


@pytest.mark.parametrize("depth_max, levels", [(4095, [0, 2047, 4095]), (255, [0, 100, 255])])
def test_12_and_8_bit_data_stored_in_16_bits_keep_their_brightness(depth_max, levels):
    """A 12-bit sensor's values (up to 4095), or 8-bit data stored wide, scaled by the 16-bit
    range would train at 1/16 of their brightness, or black: each scales by its own depth."""
    img = Image.fromarray(np.array([levels], dtype=np.uint16))
    assert img.mode == "I;16"
    expected = [round(255 * v / depth_max) for v in levels]
    assert list(np.asarray(to_rgb(img))[0, :, 0]) == expected


def test_a_flat_deep_colour_image_keeps_its_level():
    assert to_rgb(Image.fromarray(np.full((2, 2), 77.0, dtype=np.float32))).getpixel((0, 0)) \
        == (77, 77, 77)
    assert to_rgb(Image.fromarray(np.full((2, 2), 7e5, dtype=np.int32))).getpixel((0, 0)) \
        == (255, 255, 255)


def test_a_large_16_bit_image_converts_in_bounded_memory():
    side = 4000
    ramp = np.linspace(0, 65535, side, dtype=np.float64).astype(np.uint16)
    img = Image.fromarray(np.broadcast_to(ramp, (side, side)).copy())
    assert img.mode == "I;16"
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        rgb = to_rgb(img)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * side * side, f"{peak / side**2:.1f} bytes a pixel"  # float64 whole: 24+
    assert rgb.getpixel((0, 0)) == (0, 0, 0) and rgb.getpixel((side - 1, 7)) == (255,) * 3


# ----------------------------------------------------------------------------- model files

CLASSES = ["cat", "dog", "fish"]


@pytest.fixture
def payload(tmp_path):
    model = build_model("squeezenet1_1", len(CLASSES), weights="none")
    path = save_model(model, tmp_path / "good.pt", arch="squeezenet1_1", class_names=CLASSES,
                      image_size=32)
    return torch.load(path, weights_only=True)


def _hostile(tmp_path, payload, **changes) -> Path:
    path = tmp_path / "hostile.pt"
    torch.save({**payload, **changes}, path)
    return path


@pytest.mark.parametrize("changes, named", [
    ({"image_size": 100_000}, "image_size must be an integer in 17..2048"),
    ({"image_size": 8}, "image_size must be an integer in 17..2048"),
    ({"image_size": "224"}, "image_size"),
    ({"image_size": True}, "image_size"),
    ({"arch": "vit_h_14"}, "arch must be one of"),
    ({"arch": ["resnet18"]}, "arch must be one of"),
    ({"class_names": "cat,dog,fish"}, "class_names must be a list"),
    ({"class_names": {"cat": 0, "dog": 1, "fish": 2}}, "class_names must be a list"),
    ({"class_names": ["cat", 2, "fish"]}, "class_names must all be strings"),
    ({"class_names": []}, "at least 2 class_names"),
    ({"mean": [0.5, 0.5]}, "mean must be 3 finite numbers"),
    ({"mean": ["0.5", "0.5", "0.5"]}, "mean must be 3 finite numbers"),
    ({"std": [0.2, float("nan"), 0.2]}, "std must be 3 finite numbers"),
    ({"std": [0.2, 0.0, 0.2]}, "std must be > 0"),
    ({"state_dict": {"features.0.weight": [1.0, 2.0]}}, "state_dict must map"),
    ({"state_dict": [torch.zeros(1)]}, "state_dict must map"),
    ({"state_dict": {}}, "state_dict must map"),
    ({"num_classes": "3"}, "num_classes"),
    ({"num_classes": 3.0}, "num_classes=3.0 for 3 class_names"),
])
def test_a_model_file_claiming_bad_values_is_a_user_error(tmp_path, payload, changes, named):
    path = _hostile(tmp_path, payload, **changes)
    with pytest.raises(UserError, match=named) as err:
        load_model(path)
    assert "hostile.pt" in str(err.value) and "\n" not in str(err.value)


def test_a_model_file_whose_tensors_do_not_fit_is_refused_before_building(tmp_path, payload,
                                                                         monkeypatch):
    # 200000 class names over a 3-class state dict: building first would allocate the head.
    names = [f"c{i}" for i in range(200_000)]
    path = _hostile(tmp_path, payload, class_names=names, num_classes=len(names))
    built = []
    real_build = build_model

    def counting_build(*args, **kwargs):
        built.append(torch.empty(0).device.type)  # the default device at build time
        return real_build(*args, **kwargs)
    monkeypatch.setattr("modules.model_files.build_model", counting_build)
    with pytest.raises(UserError, match=r"classifier.1.weight is \(3, 512, 1, 1\)") as err:
        load_model(path)
    assert built == ["meta"] and len(str(err.value)) < 400


def test_a_model_file_missing_a_key_is_a_user_error(tmp_path, payload):
    del payload["image_size"]
    with pytest.raises(UserError, match="missing image_size"):
        load_model(_hostile(tmp_path, payload))


def test_truncated_text_and_pickled_code_files_are_user_errors(tmp_path, payload):
    good = _hostile(tmp_path, payload)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "notes.pt"
    text.write_text("arch: resnet18\n")
    marker = tmp_path / "ran"

    class Payload:  # unpickling it would create `marker`
        def __reduce__(self):
            return (open, (str(marker), "w"))
    code = tmp_path / "code.pt"
    torch.save({**payload, "extra": Payload()}, code)
    plain_pickle = tmp_path / "plain.pt"
    plain_pickle.write_bytes(pickle.dumps(Payload(), protocol=2))
    for path, said in ((truncated, "is cut short"), (text, "not a readable PyTorch file"),
                       (code, "not a readable PyTorch file"),
                       (plain_pickle, "not a readable PyTorch file")):
        with pytest.raises(UserError, match=said) as err:
            load_model(path)
        assert path.name in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_a_file_cut_short_in_its_first_64_kib_is_said_so(tmp_path, payload):
    """torch's zip reader seeks 64 KiB back from the end to find the central directory: a
    file cut short below that raised OSError(EINVAL), which was taken for the disk failing.
    A checkpoint so cut stopped --resume with no remedy, and a <dataset>_model.pt so cut was
    never set aside, so that no later run saved its best model."""
    from modules.files import read_torch_file
    whole = tmp_path / "whole.pt"
    torch.save({"big": torch.zeros(200_000)}, whole)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[:30_000])
    with pytest.raises(UserError, match=r"is cut short \(an incomplete copy or download\?\); "
                                        "delete it"):
        read_torch_file(cut, "checkpoint", "delete it")


def test_a_model_file_changed_on_disk_is_refused_not_loaded(tmp_path, payload):
    """torch.load reads a zip without checking its stored checksums: a file with one weight
    changed by a bad copy loaded, and predicted one class for every image under the accuracy
    its meta claimed. An empty file, and a folder, are said as what they are."""
    import zipfile
    good = _hostile(tmp_path, payload)
    with zipfile.ZipFile(good) as archive:
        entry = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size)
    raw = bytearray(good.read_bytes())
    local = entry.header_offset  # the local header's own name and extra lengths (padding)
    start = local + 30 + int.from_bytes(raw[local + 26:local + 28], "little") + \
        int.from_bytes(raw[local + 28:local + 30], "little")
    raw[start] ^= 0x40  # one bit of one stored weight
    flipped = tmp_path / "flipped.pt"
    flipped.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"is damaged: .*data/\d+ in it does not match its "
                                        r"checksum \(a bad copy or disk\?\)"):
        load_model(flipped)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(UserError, match="model file '.*empty.pt' is empty"):
        load_model(tmp_path / "empty.pt")
    with pytest.raises(UserError, match="is a folder, not a model file"):
        load_model(tmp_path)
    assert load_model(good).meta["class_names"]  # the checksums of a good file pass


def test_a_good_model_file_still_loads(tmp_path, payload):
    model = load_model(_hostile(tmp_path, payload))
    assert model.meta["class_names"] == CLASSES and model.meta["image_size"] == 32


def test_an_integer_image_size_of_numpy_or_torch_is_saved_as_an_int(tmp_path):
    """TrainConfig takes np.int64(64) as a size; save_model refused it in one line, as it
    refuses a float."""
    import numpy as np
    net = build_model("squeezenet1_1", 3, "none")
    for size in (np.int64(64), torch.tensor(64)):
        path = save_model(net, tmp_path / "m.pt", arch="squeezenet1_1", class_names=CLASSES,
                          image_size=size)
        assert type(load_model(path).meta["image_size"]) is int
    for size in (64.0, torch.tensor(64.0), "64"):
        with pytest.raises(UserError, match="image_size must be an integer"):
            save_model(net, tmp_path / "f.pt", arch="squeezenet1_1", class_names=CLASSES,
                       image_size=size)


def test_the_saved_and_logged_command_line_has_no_storage_secret(tmp_path, monkeypatch, capfd):
    """run.json and latest_run.json keep the command for --resume's log line: a --storage
    URL in it shows driver, host, port and database only, from the command line (sys.argv)
    and from the notebook's options() alike."""
    import pipeline
    from conftest import make_folder
    from modules.storage import shown_argv
    # Log to this test's stderr: a handler an earlier test left writes to a closed stream, and
    # logging's error report quotes the source line, password included.
    pipeline.setup_logging()
    url = "postgresql+psycopg://alice:S3cretPw@dbhost/optuna?password=S3cretPw"
    assert shown_argv(["--storage", url, f"--storage={url}", "--seed", "1"]) == [
        "--storage", "postgresql+psycopg://dbhost/optuna",
        "--storage=postgresql+psycopg://dbhost/optuna", "--seed", "1"]
    # argparse takes an option's unambiguous start: --stor is --storage, and was saved whole
    assert shown_argv(["--stor", url, f"--sto={url}", "--st", url]) == [
        "--stor", "postgresql+psycopg://dbhost/optuna",
        "--sto=postgresql+psycopg://dbhost/optuna", "--st", "postgresql+psycopg://dbhost/optuna"]
    assert pipeline.parse_args(["--st", "sqlite:///x.db"]).storage == "sqlite:///x.db"
    assert "S3cretPw" not in pipeline.options(scenarios="baseline", storage=url).command
    data = make_folder(tmp_path / "d", n_train=4, n_test=2)
    out = tmp_path / "out"
    argv = ["--data-dir", str(data), "--output-dir", str(out), "--scenarios", "baseline",
            "--epochs", "1", "--image-size", "32", "--batch-size", "8", "--weights", "none",
            "--no-progress", "--storage", url]
    monkeypatch.setattr(sys, "argv", ["pipeline.py", *argv])
    assert pipeline.main(argv) == 0 and pipeline.main([*argv, "--resume"]) == 0
    logged = capfd.readouterr().err
    saved = [out / "latest_run.json", *out.glob("checkpoints/*/run.json")]
    assert len(saved) == 2 and "dbhost/optuna" in saved[0].read_text()
    for path in saved:
        assert "S3cretPw" not in path.read_text() and "alice" not in path.read_text(), path
    assert "resuming run" in logged and "S3cretPw" not in logged
