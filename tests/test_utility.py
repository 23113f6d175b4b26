"""Tests for modules.utility: model files, prediction, the results table and the plots."""
from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from modules.config import IMAGENET_MEAN, IMAGENET_STD, UserError
from modules.models import build_model
from modules.utility import (evaluate, load_model, plot_comparison, predict, results_table,
                             save_model, table_markdown)

CLASSES = ["cat", "dog", "fish"]
IMAGE_SIZE = 64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def saved(tmp_path):
    """A random-init squeezenet1_1 with 3 classes, saved; returns (model, path)."""
    torch.manual_seed(0)
    model = build_model("squeezenet1_1", len(CLASSES), weights="none").eval()
    path = save_model(model, tmp_path / "model.pt", arch="squeezenet1_1", class_names=CLASSES,
                      image_size=IMAGE_SIZE, extra={"test_acc": 0.5})
    return model, path


def _write_images(directory):
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8), "RGB")
    gray = Image.fromarray(rng.integers(0, 256, (30, 30), dtype=np.uint8), "L")
    rgba = Image.fromarray(rng.integers(0, 256, (20, 35, 4), dtype=np.uint8), "RGBA")
    paths = []
    for name, img in (("rgb.png", rgb), ("gray.png", gray), ("rgba.png", rgba)):
        img.save(directory / name)
        paths.append(directory / name)
    return paths


def test_load_model_gives_identical_outputs(saved):
    model, path = saved
    loaded = load_model(path)
    x = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert not loaded.training
    assert loaded.meta["class_names"] == CLASSES
    assert loaded.meta["image_size"] == IMAGE_SIZE
    assert loaded.meta["extra"] == {"test_acc": 0.5}


def test_predict_returns_class_labels_and_normalised_probs(saved, tmp_path):
    paths = _write_images(tmp_path)
    results = predict(load_model(saved[1]), paths, batch_size=2)
    assert [r["path"] for r in results] == [str(p) for p in paths]
    for r in results:
        assert r["label"] in CLASSES
        assert list(r["probs"]) == CLASSES
        assert math.isclose(sum(r["probs"].values()), 1.0, abs_tol=1e-5)
        assert r["prob"] == max(r["probs"].values())


def test_predict_refuses_what_is_not_a_path_in_one_line(saved, tmp_path):
    """A PIL image, an array or a tensor was read into paths by str(): an array gave one
    'File name too long' per pixel row, a tensor labels None, a PIL image a traceback. A bytes
    path is a path."""
    model = load_model(saved[1])
    paths = _write_images(tmp_path)
    with Image.open(paths[0]) as img:
        for given in (img, [img], np.asarray(img), torch.rand(2, 3, 32, 32)):
            with pytest.raises(UserError, match=r"predict takes image file paths, but got a "
                                                r"\w+; save the image to a file"):
                predict(model, given)
    assert predict(model, os.fsencode(paths[0]))[0]["label"] in CLASSES


def test_an_undecodable_file_loses_no_other_prediction(saved, tmp_path, caplog):
    good = _write_images(tmp_path)
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    missing = tmp_path / "gone.jpg"
    paths = [good[0], bad, *good[1:], missing]
    with caplog.at_level(logging.WARNING):
        results = predict(load_model(saved[1]), paths, batch_size=2)
    assert [r["path"] for r in results] == [str(p) for p in paths]
    assert [r["error"] is None for r in results] == [True, False] + [True] * (len(good) - 1) + [False]
    for r in results:
        if r["error"] is None:
            assert r["label"] in CLASSES
        else:
            assert (r["label"], r["prob"], r["probs"]) == (None, None, {})
    alone = predict(load_model(saved[1]), good)
    for r, same in zip([r for r in results if r["error"] is None], alone, strict=True):
        assert r["label"] == same["label"]
        assert all(math.isclose(r["probs"][c], same["probs"][c], abs_tol=1e-5) for c in CLASSES)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "2 of" in warned[0] and "broken.png" in warned[0]


def test_the_prediction_grid_leaves_out_a_test_image_gone_since_the_run(saved, tmp_path):
    from modules.report import PREDICTIONS_PNG, plot_predictions
    good = _write_images(tmp_path)
    samples = [(str(good[0]), 0), (str(tmp_path / "gone.jpg"), 1)]
    out = tmp_path / "out"
    out.mkdir()
    assert plot_predictions(saved[1], samples, CLASSES, out) == out / PREDICTIONS_PNG
    assert plot_predictions(saved[1], samples[1:], CLASSES, out) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_device_that_is_not_here_is_a_one_line_user_error(saved, tmp_path):
    model = load_model(saved[1], device="auto")
    loader = [(torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE), torch.tensor([0, 2]))]
    assert evaluate(model, loader, device="auto")["n"] == 2
    for device in ("cuda", "cuda:1", "gpu0", "mps", "xpu", "meta"):
        with pytest.raises(UserError, match=repr(device)):
            load_model(saved[1], device=device)
        with pytest.raises(UserError, match=repr(device)):
            predict(model, _write_images(tmp_path), device=device)
        with pytest.raises(UserError, match=repr(device)):
            evaluate(model, loader, device=device)
    assert predict(model, _write_images(tmp_path), device=torch.device("cpu"))
    assert predict(model, _write_images(tmp_path))  # the refused "meta" left its weights


def test_evaluate_runs_the_model_on_the_device_it_is_given(saved, monkeypatch):
    """load_model loads on the CPU: evaluate(model, loader, device="cuda") moved the images
    there but not the model, and failed with torch's weight-type traceback."""
    model = load_model(saved[1])
    moved = []
    monkeypatch.setattr(model, "to", lambda *args, **kwargs: moved.append(args) or model)
    loader = [(torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE), torch.tensor([0, 2]))]
    assert evaluate(model, loader, device="cpu")["n"] == 2
    assert moved == [(torch.device("cpu"),)]


def test_evaluating_a_model_without_a_class_count_is_a_user_error():
    model = build_model("squeezenet1_1", len(CLASSES), weights="none")
    del model.num_classes  # as a torchvision model built directly
    loader = [(torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE), torch.tensor([0, 2]))]
    with pytest.raises(UserError, match="no num_classes"):
        evaluate(model, loader)
    assert evaluate(model, loader, num_classes=len(CLASSES))["n"] == 2


def test_saved_file_loads_with_weights_only(saved):
    payload = torch.load(saved[1], weights_only=True)
    assert payload["arch"] == "squeezenet1_1"
    assert payload["class_names"] == CLASSES
    assert all(t.device.type == "cpu" for t in payload["state_dict"].values())


def test_numpy_class_names_and_arch_are_saved_as_strings_that_load_back(tmp_path):
    model = build_model("squeezenet1_1", len(CLASSES), weights="none")
    path = save_model(model, tmp_path / "m.pt", arch=np.str_("squeezenet1_1"),
                      class_names=np.array(CLASSES), image_size=IMAGE_SIZE)  # a LabelEncoder's
    meta = load_model(path).meta
    assert meta["class_names"] == CLASSES and type(meta["class_names"][0]) is str
    assert type(meta["arch"]) is str


def test_a_model_that_does_not_fit_its_arch_or_class_names_is_not_saved(tmp_path):
    six = build_model("resnet18", 6, weights="none")
    for arch, names in (("resnet18", list("abcde")), ("squeezenet1_1", list("abcdef"))):
        with pytest.raises(UserError, match=f"does not match architecture '{arch}'") as err:
            save_model(six, tmp_path / "m.pt", arch=arch, class_names=names,
                       image_size=IMAGE_SIZE)
        assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_save_strips_compile_and_ddp_prefixes(tmp_path):
    model = build_model("squeezenet1_1", 3, weights="none")

    class Wrapper(torch.nn.Module):  # stands in for torch.compile's OptimizedModule
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    path = save_model(Wrapper(model), tmp_path / "m.pt", arch="squeezenet1_1",
                      class_names=CLASSES, image_size=IMAGE_SIZE)
    keys = torch.load(path, weights_only=True)["state_dict"].keys()
    assert set(keys) == set(model.state_dict().keys())
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write leaves no temp file


def test_saving_below_a_file_is_one_line_not_a_traceback(tmp_path, saved):
    """save_model to a path through a file (notes.txt/model.pt) raised a bare FileExistsError
    from making its folder, where the same mistake in a write already had its line."""
    model, _ = saved
    (tmp_path / "notes.txt").write_text("x")
    for target in ("notes.txt/model.pt", "notes.txt/sub/model.pt"):
        with pytest.raises(UserError, match="a file stands where a folder of that path is to "
                                            "be; move it, then try again.$"):
            save_model(model, tmp_path / target, arch="squeezenet1_1", class_names=CLASSES,
                       image_size=IMAGE_SIZE)


def test_load_model_rejects_non_model_file(tmp_path):
    other = tmp_path / "notes.pt"
    torch.save({"weights": [1, 2, 3]}, other)
    with pytest.raises(UserError, match=r"not a model saved by save_model \(a bare "
                                        r"state_dict\? .*model.load_state_dict"):
        load_model(other)
    # a run's checkpoint was taken for a bare state_dict, and the advice was an option
    checkpoint = tmp_path / "baseline.pt"
    torch.save({"format": 1, "config": {}, "model": {}}, checkpoint)
    with pytest.raises(UserError, match=r"\(a run's checkpoint, which --resume continues from: "
                                        r"the run's best model is the <data set>_model.pt"):
        load_model(checkpoint)
    with pytest.raises(UserError, match="no such model file"):
        load_model(tmp_path / "missing.pt")
    text = tmp_path / "text.pt"
    text.write_text("hello")
    with pytest.raises(UserError, match="not a readable PyTorch file"):
        load_model(text)


def test_results_table_formats_percentages_and_na():
    rows = [
        {"scenario": "baseline", "train_acc": 0.9, "test_acc": 0.8766, "train_loss": 0.31234,
         "gpu_util_pct": None, "cpu_util_pct": 55.0, "epochs": 3, "settings": {"lr": 1e-3}},
        {"scenario": "fast", "test_acc": 0.5, "gpu_util_pct": 0.0, "test_acc_vs_baseline": -37.66,
         "total_vs_baseline": 0.5},
    ]
    df = results_table(rows)
    assert list(df.index) == ["baseline", "fast"]
    assert df.loc["baseline", "Train Acc (%)"] == "90.0"
    assert df.loc["baseline", "Test Acc (%)"] == "87.7"
    assert df.loc["baseline", "Train Loss"] == "0.3123"
    assert df.loc["baseline", "GPU Util (%)"] == "n/a"
    assert df.loc["fast", "GPU Util (%)"] == "0.0"  # a measured zero stays zero
    assert df.loc["fast", "Train (s)"] == "n/a"  # missing key
    # Train + Setup + Tuning = Total: without Setup (the final run's loaders, its decode) the
    # columns did not add up
    assert list(df.columns[list(df.columns).index("Train (s)"):][:4]) == [
        "Train (s)", "Setup (s)", "Tuning (s)", "Total (s)"]
    assert df.loc["fast", "Test Acc vs Baseline (pts)"] == "-37.7"  # signed points
    assert df.loc["fast", "Time vs Baseline (x)"] == "0.50"
    assert df.loc["baseline", "To Baseline Val Acc (s)"] == "n/a"
    for header in ("Best Resolution", "CPU Exec (us/batch)", "Step (ms)", "Throughput (img/s)",
                   "Peak Mem (MiB)", "Data Wait (%)"):
        assert header in df.columns


def test_table_markdown_shape():
    df = results_table([{"scenario": "a", "test_acc": 0.5},
                        {"scenario": "b|c", "diagnosis": "slow\ndata"}])
    lines = table_markdown(df).splitlines()
    assert len(lines) == 2 + len(df)
    assert lines[0].startswith("| Scenario | Train Acc (%)")
    assert set(lines[1]) <= set("|-")
    # Every row has the same number of cells, even with a "|" and a newline in a value.
    cells = [len(line.replace("\\|", "").split("|")) for line in lines]
    assert len(set(cells)) == 1 and cells[0] == len(df.columns) + 3


def test_plot_comparison_writes_png_and_html(tmp_path):
    histories = {
        "baseline": [{"epoch": 1, "train_loss": 1.2, "val_loss": 1.3, "train_acc": 0.4,
                      "val_acc": 0.35},
                     {"epoch": 2, "train_loss": 0.9, "val_loss": None, "train_acc": 0.6,
                      "val_acc": float("nan")}],
        "amp": [{"epoch": 1, "train_loss": 1.1, "val_loss": 1.2, "train_acc": 0.45,
                 "val_acc": 0.4}],
    }
    paths = plot_comparison(histories, tmp_path / "plots")
    names = {p.name for p in paths}
    assert {"training_loss_comparison.png", "training_accuracy_comparison.png",
            "training_comparison.html"} <= names
    for p in paths:
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    html = (tmp_path / "plots" / "training_comparison.html").read_text(encoding="utf-8")
    assert 'src="plotly.min.js"' in html and "cdn.plot.ly" not in html
    assert (tmp_path / "plots" / "plotly.min.js").stat().st_size > 100_000
    # loss on the left panel's axes, accuracy on the right's
    from modules.report import comparison_figure
    axes = {(t.name, t.yaxis): max(t.y) for t in comparison_figure(histories).data}
    assert axes[("baseline (train)", "y")] == 1.2 and axes[("baseline (train)", "y2")] == 60
    # a scenario that took another's run (hpo: the resolution final run) is drawn over it
    names = {t.name for t in comparison_figure({**histories, "hpo": histories["amp"]}).data}
    assert "hpo (= amp's run) (val)" in names and "amp (val)" in names


def test_plot_comparison_empty_writes_nothing(tmp_path):
    assert plot_comparison({}, tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


def test_a_class_without_test_images_has_no_accuracy_not_zero(tmp_path, monkeypatch):
    """A seeded split can leave a tiny class out of the test split: its accuracy is unknown
    (null in results.json, "no test images" on the chart), not 0%."""
    from modules.evaluation import evaluate
    from modules.report import plot_confusion
    from modules.results import json_safe

    class AlwaysFirst(torch.nn.Module):
        num_classes = 3

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return torch.tensor([[5.0, 0.0, 0.0]]).expand(len(x), 3) + self.w

    loader = [(torch.zeros(4, 3, 8, 8), torch.tensor([0, 0, 1, 1]))]
    result = evaluate(AlwaysFirst(), loader, device="cpu")
    assert result["per_class_acc"][:2] == [1.0, 0.0] and math.isnan(result["per_class_acc"][2])
    row = {"scenario": "baseline", "confusion_matrix": result["confusion"],
           "per_class_test_acc": dict(zip(CLASSES, result["per_class_acc"]))}
    assert json_safe(row)["per_class_test_acc"]["fish"] is None
    import matplotlib.axes
    labels = []
    original = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate",
                        lambda ax, text, *a, **k: labels.append(text) or original(ax, text, *a, **k))
    for shown in (row, json_safe(row)):  # in memory (NaN) and read back (null)
        labels.clear()
        path = plot_confusion(shown, tmp_path)
        assert path.read_bytes().startswith(PNG_MAGIC)
        assert labels == ["100", "0", "no test images"]


def test_non_finite_logits_are_no_prediction():
    """argmax reads NaN as the largest: a model answering NaN scored class 0 right (66.7% on
    four of six images of class 0) beside a NaN loss."""
    from modules.evaluation import evaluate

    class Broken(torch.nn.Module):
        num_classes = 3

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):  # the first two images' logits overflow, the rest predict 0
            out = torch.tensor([[5.0, 0.0, 0.0]]).repeat(len(x), 1) + self.w
            out[:2] = float("nan")
            return out

    y = torch.tensor([0, 0, 0, 0, 1, 2])
    result = evaluate(Broken(), [(torch.zeros(6, 3, 8, 8), y)], device="cpu")
    assert result["acc"] == pytest.approx(2 / 6) and result["n"] == 6 and result["unscored"] == 2
    assert result["per_class_acc"] == pytest.approx([0.5, 0.0, 0.0])
    assert sum(map(sum, result["confusion"])) == 4
    # the loss is the four scored images' (two right at 0.013, two wrong at 5.013), not NaN
    assert result["loss"] == pytest.approx((2 * 0.01339 + 2 * 5.01339) / 4, abs=1e-4)


def test_class_names_that_read_as_numbers_plot_without_a_log_line(tmp_path, caplog):
    """Digit folders are named 0..9: the per-class chart says nothing in the run's log."""
    from modules.report import plot_confusion

    names = [str(i) for i in range(3)]
    row = {"scenario": "baseline", "confusion_matrix": [[2, 0, 0], [0, 1, 1], [0, 0, 2]],
           "per_class_test_acc": dict(zip(names, [1.0, 0.5, 1.0]))}
    with caplog.at_level(logging.INFO):
        path = plot_confusion(row, tmp_path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert not [r for r in caplog.records if r.name.startswith("matplotlib")]


def test_the_confusion_chart_of_many_classes_stays_a_readable_size(tmp_path):
    """100 classes drew a 10,340 x 6,215 px chart with a number in each of 10,000 cells (2.5 GB
    and 14 s after training; 200 classes, a file Pillow refuses to open). Beyond 30 classes the
    chart keeps the 30-class size, shades the shares and shows the classes learned worst."""
    import numpy as np
    from PIL import Image
    from modules.report import CONFUSION_FULL, plot_confusion

    def chart(n: int) -> tuple[int, int]:
        rng = np.random.default_rng(n)
        names = [f"class{i:03d}" for i in range(n)]
        row = {"scenario": "baseline", "confusion_matrix": rng.integers(0, 5, (n, n)).tolist(),
               "per_class_test_acc": dict(zip(names, rng.random(n).tolist()))}
        with Image.open(plot_confusion(row, tmp_path, f"c{n}.png")) as img:
            return img.size
    full = chart(CONFUSION_FULL)
    assert chart(200) == full and chart(CONFUSION_FULL // 2)[0] < full[0]
    assert full[0] * full[1] < 20e6  # pixels: a chart, not a poster


def test_predict_decodes_as_an_older_model_was_tested_on_the_decoded_cache(tmp_path):
    """Before 2026-12-07 the tuned scenarios tested on JPEGs decoded at reduced scale (draft)
    into the cache, and a model saved from them records it: predict decodes new images alike,
    the pixels it sees the cache's, not a full decode's (up to 0.3 normalised units apart)."""
    import numpy as np
    from PIL import Image

    from modules import prediction
    from modules.dataset import eval_transform, load_rgb
    path = tmp_path / "photo.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (480, 640, 3), np.uint8)).save(path, quality=90)
    size = 32
    drafted_rgb = load_rgb(path, draft=size).resize((size, size), Image.BILINEAR)
    cached = torch.from_numpy(np.array(drafted_rgb)).permute(2, 0, 1)
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    expected = (cached.float() / 255 - mean) / std
    transform = eval_transform(size)
    drafted = transform(prediction._decode(str(path), draft=size)[0])
    full = transform(prediction._decode(str(path))[0])
    assert torch.allclose(drafted, expected, atol=1e-5)
    assert (full - expected).abs().max() > 0.05


def test_earlier_runs_are_listed_newest_first_rows_without_an_id_last():
    from modules.report import earlier_runs_lines
    rows = [{"run_id": None, "dataset": "d", "scenario": "baseline", "test_acc": 0.5},
            {"run_id": "20261128-090000", "dataset": "d", "scenario": "baseline", "test_acc": 0.6},
            {"run_id": "20261129-090000", "dataset": "d", "scenario": "hpo", "test_acc": 0.7}]
    lines = earlier_runs_lines(rows)
    assert [line.split(":")[0] for line in lines] == ["- 20261129-090000", "- 20261128-090000",
                                                      "- before run ids"]


def test_an_unscored_image_leaves_the_splits_loss_finite():
    """Its logits overflowed (inf, as fp16 can): left out of the accuracy, but its loss made
    the split's NaN, in every epoch's val_loss and the row's test loss."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Overflowing(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            out = self.fc(x)
            return torch.where(x[:, :1] > 100, torch.full_like(out, float("inf")), out)
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    x[7, 0] = 1e4
    model = Overflowing()
    result = evaluate(model, DataLoader(TensorDataset(x, y), batch_size=16), device="cpu",
                      num_classes=3)
    assert result["unscored"] == 1 and result["n"] == 64
    keep = torch.arange(64) != 7
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x[keep]), y[keep]).item()
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_model_file_whose_extra_is_not_a_dict_is_damaged(saved, tmp_path):
    """`extra` is read as a dict by the run's best-model check and by predict: any other value
    was an AttributeError traceback there."""
    payload = torch.load(saved[1], weights_only=True)
    payload["extra"] = "draft"
    torch.save(payload, tmp_path / "odd.pt")
    with pytest.raises(UserError, match=r"is damaged: extra must be a dict or absent"):
        load_model(tmp_path / "odd.pt")


def test_a_non_finite_output_is_no_prediction(saved, tmp_path, caplog):
    """A NaN head (a diverged model) made every image the first class, with probability nan;
    such an image has no label, and its entry says why, as evaluation counts it unscored."""
    model = load_model(saved[1])
    with torch.no_grad():
        model.classifier[1].weight.fill_(float("nan"))
    with caplog.at_level(logging.WARNING):
        results = predict(model, _write_images(tmp_path))
    assert all(r["label"] is None and r["prob"] is None for r in results)
    assert "NaN/inf" in results[0]["error"] and "3 of 3 image(s) have no prediction" in caplog.text


def test_class_names_the_chart_font_lacks_warn_nothing(tmp_path):
    """CJK class names: matplotlib warned once per missing letter, with its source line, on
    the console of every run (the names still draw, as boxes)."""
    import warnings
    from modules.report import plot_confusion
    row = {"scenario": "baseline", "confusion_matrix": [[3, 1], [0, 4]],
           "per_class_test_acc": {"café": 0.75, "日本 語": 1.0}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plot_confusion(row, tmp_path).read_bytes().startswith(PNG_MAGIC)
    assert not [w for w in caught if "missing from font" in str(w.message)]
