"""The model zoo: heads sized to the classes, ImageNet weights from the hub cache or a clear
offline fallback, and weights from a file."""
import logging
import urllib.error

import pytest
import torch
import torchvision

from modules import membership, models
from modules.config import UserError
from modules.models import build_model


@pytest.mark.parametrize("name", ["squeezenet1_1", "resnet18", "mobilenet_v3_small"])
def test_heads_have_one_output_per_class(name):
    model = build_model(name, 4).eval()
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 4) and model.num_classes == 4


def test_offline_imagenet_weights_fall_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no cached copy

    def offline(*_, **__):
        raise urllib.error.URLError("[Errno -2] Name or service not known")
    import torchvision.models._api as api  # what torchvision calls
    monkeypatch.setattr(api, "load_state_dict_from_url", offline)
    with caplog.at_level(logging.WARNING):
        build_model("squeezenet1_1", 6, "imagenet")
        build_model("squeezenet1_1", 6, "imagenet")  # a tuner builds many: said once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not be fetched" in warnings[0]
    assert "random initialization" in warnings[0]
    # results.json and report.md say the run started at random, not from "imagenet"
    assert models.start_weights("squeezenet1_1", "imagenet") == \
        "random (ImageNet weights unreachable)"
    assert models.start_weights("resnet18", "imagenet") == "imagenet"
    assert models.start_weights("squeezenet1_1", "none") == "none"
    from modules.report import render_report
    text = render_report([{"scenario": "baseline", "test_acc": 0.5,
                           "start_weights": models.start_weights("squeezenet1_1", "imagenet")}],
                         [])
    assert "Started from random (ImageNet weights unreachable)." in text


def test_imagenet_weights_come_from_the_hub_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    reference = torchvision.models.squeezenet1_1(weights=None)  # stands in for the real file
    url = torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1.url
    cached = tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]
    cached.parent.mkdir(parents=True)
    torch.save(reference.state_dict(), cached)
    model = build_model("squeezenet1_1", 6, "imagenet")
    torch.testing.assert_close(model.features[0].weight, reference.features[0].weight)


def test_a_damaged_cached_copy_is_kept_aside_and_fetched_again(tmp_path, monkeypatch, caplog):
    """torch.hub never downloads a file it has: a copy torn by a disconnect failed every run,
    with a message that blamed fetching, cut mid-word."""
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    url = torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1.url
    cached = tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"PK\x03\x04 half a zip")
    reference = torchvision.models.squeezenet1_1(weights=None)

    def download(url, model_dir, **_):  # online again: the file arrives whole
        torch.save(reference.state_dict(), cached)
        return torch.load(cached, weights_only=True)
    real = torch.hub.load_state_dict_from_url

    def hub(url, model_dir=None, **kw):
        return real(url, model_dir=model_dir, **kw) if cached.exists() else \
            download(url, model_dir)
    import torchvision.models._api as api  # what torchvision calls
    monkeypatch.setattr(api, "load_state_dict_from_url", hub)
    with caplog.at_level(logging.INFO):
        model = build_model("squeezenet1_1", 6, "imagenet")
    torch.testing.assert_close(model.features[0].weight, reference.features[0].weight)
    assert (cached.parent / (cached.name + ".unreadable")).read_bytes().startswith(b"PK")
    assert "downloaded again: the cached copy could not be read" in caplog.text
    # offline: said so, and where the damaged copy went
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    cached.write_bytes(b"garbage")

    def offline(url, model_dir=None, **kw):
        if cached.exists():
            return real(url, model_dir=model_dir, **kw)
        raise urllib.error.URLError("[Errno -2] Name or service not known")
    monkeypatch.setattr(api, "load_state_dict_from_url", offline)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        build_model("squeezenet1_1", 6, "imagenet")
    assert "could not be read and is kept aside" in caplog.text and not cached.exists()


def test_weights_from_a_file_fit_a_new_head(tmp_path):
    source = build_model("resnet18", 10)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    model = build_model("resnet18", 3, str(tmp_path / "w.pt"))
    torch.testing.assert_close(model.conv1.weight, source.conv1.weight)
    assert model.fc.out_features == 3


def test_a_run_starts_every_model_from_its_weights_file_as_it_read_it_first(tmp_path,
                                                                          monkeypatch):
    """The file was read again for every model built: another run saving its best model over
    it mid-run started this run's later scenarios and trials from other weights, recorded
    under the same name. The run reads it once, as it starts."""
    import scenario
    from conftest import make_folder
    import pipeline
    first, second = build_model("squeezenet1_1", 3), build_model("squeezenet1_1", 3)
    start = tmp_path / "start.pt"
    torch.save(first.state_dict(), start)
    built = []

    def scenarios(args, index, output_dir, device):  # another run saves over it meanwhile
        torch.save(second.state_dict(), start)
        built.append(build_model("squeezenet1_1", 3, str(start)))
        return []
    monkeypatch.setattr(scenario, "_run_scenarios", scenarios)
    data = make_folder(tmp_path / "d", n_train=6, n_test=2)
    scenario.run(pipeline.parse_args(["--data-dir", str(data), "--output-dir", str(tmp_path / "o"),
                                      "--weights", str(start), "--no-progress"]))
    for name, tensor in first.state_dict().items():
        torch.testing.assert_close(built[0].state_dict()[name], tensor)
    # the run over, the file is read as it is now
    after = build_model("squeezenet1_1", 3, str(start))
    torch.testing.assert_close(after.features[0].weight, second.features[0].weight)


def test_weights_for_the_same_classes_load_whole_head_included(tmp_path):
    """A tuner's trial is continued by the final run: its classifier too, not a fresh one."""
    from modules.checkpoints import save_weights
    source = build_model("squeezenet1_1", 6)
    save_weights(source, tmp_path / "trial.weights.pt")
    model = build_model("squeezenet1_1", 6, str(tmp_path / "trial.weights.pt"))
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor)


def test_weights_from_a_runs_checkpoint_are_its_model(tmp_path):
    """--weights others/checkpoints/<run>/baseline.pt: the model inside the training state,
    not 'no tensor fits'."""
    from modules.checkpoints import save_checkpoint
    from modules.config import TrainConfig
    source = build_model("squeezenet1_1", 6)
    save_checkpoint(tmp_path / "baseline.pt", {
        "epoch": 3, "finished": False, "config": TrainConfig().to_dict(),
        "model": source.state_dict(), "optimizer": {"state": {}, "param_groups": []}})
    model = build_model("squeezenet1_1", 6, str(tmp_path / "baseline.pt"))
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor)
    # with a best epoch before its last: the best epoch's, the model the run ends with (the
    # last epoch's was loaded, which early stopping had passed over)
    best = build_model("squeezenet1_1", 6)
    save_checkpoint(tmp_path / "stopped.pt", {
        "epoch": 5, "finished": True, "config": TrainConfig().to_dict(),
        "model": source.state_dict(), "optimizer": {"state": {}, "param_groups": []},
        "best": {"acc": 0.9, "epoch": 2, "state": best.state_dict()}})
    model = build_model("squeezenet1_1", 6, str(tmp_path / "stopped.pt"))
    for name, tensor in best.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor)


def test_weights_of_another_architecture_are_refused(tmp_path):
    torch.save(build_model("resnet18", 3).state_dict(), tmp_path / "w.pt")
    with pytest.raises(UserError, match="no tensor"):
        build_model("squeezenet1_1", 3, str(tmp_path / "w.pt"))
    # SqueezeNet 1.0: 30 of 1.1's 52 tensors fit by shape alone; the rest do not
    torch.save(torchvision.models.squeezenet1_0().state_dict(), tmp_path / "w10.pt")
    with pytest.raises(UserError, match=r"does not fit this model: \d+ of its tensors"):
        build_model("squeezenet1_1", 3, str(tmp_path / "w10.pt"))
    # a dict whose values are not tensors is no state_dict; BatchNorm's counters may be absent
    torch.save({"features.0.weight": 5}, tmp_path / "ints.pt")
    with pytest.raises(UserError, match="no tensor"):
        build_model("squeezenet1_1", 3, str(tmp_path / "ints.pt"))
    state = {k: v for k, v in build_model("resnet18", 3).state_dict().items()
             if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "r.pt")
    build_model("resnet18", 5, str(tmp_path / "r.pt"))


def test_weights_in_common_checkpoint_layouts_load(tmp_path, caplog):
    """A Lightning checkpoint (its module's `model.` prefix, a metric's tensors beside it),
    the PyTorch tutorial's and torchvision's reference scripts' were refused as "another
    architecture" though they held this model's weights; the load line says the classifier
    starts new."""
    source = build_model("resnet18", 10)
    layouts = {
        "lightning.ckpt": {"epoch": 3, "state_dict": {
            **{f"model.{k}": v for k, v in source.state_dict().items()},
            "val_acc.correct": torch.tensor(5.0)}},
        "tutorial.pt": {"epoch": 5, "model_state_dict": source.state_dict(),
                        "optimizer_state_dict": {}},
        "reference.pth": {"model": source.state_dict(), "epoch": 5, "args": None}}
    for file, payload in layouts.items():
        torch.save(payload, tmp_path / file)
        with caplog.at_level(logging.INFO, logger="modules.models"):
            model = build_model("resnet18", 3, str(tmp_path / file))
        torch.testing.assert_close(model.conv1.weight, source.conv1.weight)
        torch.testing.assert_close(model.layer4[1].bn2.running_var, source.layer4[1].bn2.running_var)
    assert "loaded 120 of 122 tensors" in caplog.text
    assert "the classifier (fc) starts new, for 3 classes" in caplog.text
    # torchvision's reference scripts save their argparse options beside the model
    import argparse
    torch.save({"model": source.state_dict(), "epoch": 5,
                "args": argparse.Namespace(lr=0.1, model="resnet18")}, tmp_path / "args.pth")
    model = build_model("resnet18", 3, str(tmp_path / "args.pth"))
    torch.testing.assert_close(model.conv1.weight, source.conv1.weight)
    # a classifier of other layers (fine-tuning's Dropout and Linear) starts new, as any head
    tuned = torchvision.models.resnet18()
    tuned.fc = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(512, 4))
    torch.save(tuned.state_dict(), tmp_path / "head.pt")
    model = build_model("resnet18", 3, str(tmp_path / "head.pt"))
    torch.testing.assert_close(model.layer4[1].conv2.weight, tuned.layer4[1].conv2.weight)
    # the model twice (MoCo's encoders, a model and its EMA copy): which to start from is the
    # user's to say, not the first name's
    twice = {**{f"module.encoder_q.{k}": v for k, v in source.state_dict().items()},
             **{f"module.encoder_k.{k}": v for k, v in tuned.state_dict().items()},
             "module.queue": torch.zeros(4, 8)}
    torch.save({"arch": "resnet18", "state_dict": twice}, tmp_path / "moco.pth.tar")
    with pytest.raises(UserError, match=r"holds this model 2 times \(under encoder_k\., "
                                        r"encoder_q\.\): save the one to start from"):
        build_model("resnet18", 3, str(tmp_path / "moco.pth.tar"))
    # nothing by name at its top level: what it holds, not "another architecture"
    torch.save({"net": [1, 2], "epoch": 5}, tmp_path / "odd.pt")
    with pytest.raises(UserError, match=r"holds no tensor by name \(its keys: epoch, net\): "
                                        r"save the model's state_dict\(\)"):
        build_model("resnet18", 3, str(tmp_path / "odd.pt"))


def test_weights_of_a_deeper_model_or_another_saved_model_are_refused(tmp_path):
    """ResNet-34's names include ResNet-18's at their shapes: its file loaded into ResNet-18
    as "120 of 122 tensors", its further blocks dropped without a word. A model file this tool
    saved names its architecture."""
    from modules.utility import save_model
    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "r34.pt")
    with pytest.raises(UserError, match=r"does not fit this model: \d+ of the file's tensors "
                                        r"have no place in it \(first: layer1\.2\."):
        build_model("resnet18", 3, str(tmp_path / "r34.pt"))
    with pytest.raises(UserError, match="have no place in it"):
        models.check_weights_file("resnet18", tmp_path / "r34.pt")
    save_model(build_model("resnet18", 3), tmp_path / "best.pt", arch="resnet18",
               class_names=["a", "b", "c"], image_size=64)
    with pytest.raises(UserError, match=r"holds a resnet18 model, not squeezenet1_1: pass "
                                        r"--model resnet18"):
        models.check_weights_file("squeezenet1_1", tmp_path / "best.pt")
    build_model("resnet18", 4, str(tmp_path / "best.pt"))  # its own architecture: loads


def test_batchnorm_statistics_follow_the_batches_at_momentum_0_1_in_every_model():
    """torchvision's MobileNetV3 keeps them at 0.01: from random weights, 12 epochs left them so
    far behind that it validated at chance (16.5% test on synthetic, 47.3% at 0.1; digits
    10.0% and 95.0%) while training learned the same."""
    for name in ("resnet18", "mobilenet_v3_small"):
        norms = [m for m in build_model(name, 3).modules()
                 if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert norms and all(m.momentum == models.BN_MOMENTUM == 0.1 for m in norms), name
    # a few steps from random weights: evaluation's statistics near the batches', not the
    # initial ones
    torch.manual_seed(0)
    model = build_model("mobilenet_v3_small", 3)
    first = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    seen = []
    first.register_forward_hook(lambda module, inputs, output: seen.append(
        inputs[0].mean(dim=(0, 2, 3))))
    batch = torch.randn(8, 3, 32, 32) * 3 + 2
    with torch.no_grad():
        for _ in range(30):
            model(batch)
    # 1 - 0.9 ** 30 of the way to the batches' mean (0.01: 1 - 0.99 ** 30, a quarter)
    torch.testing.assert_close(first.running_mean, (1 - 0.9 ** 30) * seen[0])


def test_bytemask_dropout_keeps_dropouts_distribution_scale_and_gradient():
    torch.manual_seed(0)
    drop = models.ByteMaskDropout(0.5)
    x = torch.randn(64, 512, 3, 3).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.5) < 0.01  # 295k draws: within 0.01 of 1 - p
    torch.testing.assert_close(y[kept], 2 * x[kept])       # scaled by 1 / (1 - p)
    assert y.is_contiguous(memory_format=torch.channels_last)  # x's layout, no reorder
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() * 2)
    # masks are random, and follow torch's seed like F.dropout's
    torch.manual_seed(1)
    first = drop(x)
    torch.manual_seed(1)
    assert torch.equal(first, drop(x)) and not torch.equal(first, y)
    # elements are independent: neighbours agree about half the time, not always
    same = (kept[:, :-1] == kept[:, 1:]).float().mean().item()
    assert abs(same - 0.5) < 0.01
    # a p other than 0.5 compares random bytes with p * 256
    quarter = models.ByteMaskDropout(0.25)(x.detach())
    assert abs((quarter != 0).float().mean().item() - 0.75) < 0.01
    torch.testing.assert_close(quarter[quarter != 0], x.detach()[quarter != 0] / 0.75)
    # eval mode and odd shapes behave as nn.Dropout
    drop.eval()
    assert drop(x) is x
    drop.train()
    assert drop(torch.ones(3, 5)[:, ::2]).shape == (3, 3)


def test_bytemask_dropout_is_swapped_in_only_where_it_is_exact():
    squeeze = build_model("squeezenet1_1", 6, dropout_impl="bytemask")
    assert isinstance(squeeze.classifier[0], models.ByteMaskDropout)
    assert type(build_model("squeezenet1_1", 6).classifier[0]) is torch.nn.Dropout
    # MobileNetV3's p=0.2 is not a multiple of 1/256: it keeps nn.Dropout
    mobile = build_model("mobilenet_v3_small", 6, dropout_impl="bytemask")
    assert not any(isinstance(m, models.ByteMaskDropout) for m in mobile.modules())
    assert models.has_bytemask_dropout("squeezenet1_1")
    assert not models.has_bytemask_dropout("mobilenet_v3_small")
    assert not models.has_bytemask_dropout("resnet18")
    with pytest.raises(UserError, match="dropout_impl"):
        build_model("squeezenet1_1", 6, dropout_impl="fast")


def test_weights_from_a_compiled_or_data_parallel_model_load(tmp_path):
    """torch.compile's and DataParallel's state_dicts prefix every key; --weights takes them."""
    from torch import nn
    source = build_model("resnet18", 3, "none")
    for wrapped, name in ((nn.DataParallel(source), "dp.pt"),):
        torch.save(wrapped.state_dict(), tmp_path / name)
        loaded = build_model("resnet18", 3, str(tmp_path / name))
        for key, value in source.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key
    torch.save({f"_orig_mod.{k}": v for k, v in source.state_dict().items()}, tmp_path / "c.pt")
    loaded = build_model("resnet18", 3, str(tmp_path / "c.pt"))
    assert torch.equal(loaded.conv1.weight, source.conv1.weight)


def test_another_architecture_s_file_in_the_hub_cache_is_kept_aside(tmp_path, monkeypatch,
                                                                    caplog):
    """A loadable file of other weights under the cached name (a resnet18 state_dict) was a
    load_state_dict traceback; it is set aside as a damaged copy is, and offline the run
    trains from random, said in one warning."""
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    url = torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1.url
    cached = tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]
    cached.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), cached)
    import torchvision.models._api as api

    def offline(url, model_dir=None, **kw):
        if cached.exists():
            return torch.load(cached, weights_only=True)
        raise OSError("<urlopen error [Errno -2] Name or service not known>")
    monkeypatch.setattr(api, "load_state_dict_from_url", offline)
    with caplog.at_level(logging.WARNING):
        model = build_model("squeezenet1_1", 6, "imagenet")
    assert model.classifier[1].out_channels == 6
    assert (cached.parent / (cached.name + ".unreadable")).exists() and not cached.exists()
    assert "training from random initialization" in caplog.text


def test_imagenet_weights_saved_before_batchnorm_counted_its_steps_load(tmp_path, monkeypatch):
    """torchvision's ResNet files predate BatchNorm's num_batches_tracked: load_state_dict
    fills it in, and the check for another architecture's file must not refuse them."""
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    reference = torchvision.models.resnet18(weights=None)
    url = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url
    cached = tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]
    cached.parent.mkdir(parents=True)
    torch.save({k: v for k, v in reference.state_dict().items()
                if not k.endswith("num_batches_tracked")}, cached)
    model = build_model("resnet18", 6, "imagenet")
    torch.testing.assert_close(model.conv1.weight, reference.conv1.weight)
    assert cached.exists()


def test_a_new_run_tries_the_weights_again_and_a_stalled_fetch_times_out(tmp_path,
                                                                          monkeypatch, caplog):
    """A failed download was remembered for the whole process: after a network blip, every
    later run in the notebook's kernel started at random without a word. And a connection
    that stalled blocked the run for ever: the fetch runs under a socket timeout."""
    import socket
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    monkeypatch.setattr(models, "_TRIED", set())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    reference = torchvision.models.squeezenet1_1(weights=None).state_dict()
    timeouts = []

    def fetch(**kwargs):
        timeouts.append(socket.getdefaulttimeout())
        if len(timeouts) == 1:
            raise OSError("temporary failure in name resolution")
        return reference
    monkeypatch.setattr(torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1,
                        "get_state_dict", fetch, raising=False)
    with caplog.at_level(logging.WARNING):
        assert models.resolved_start("squeezenet1_1", "imagenet") == models.UNREACHABLE_START
    assert "could not be fetched" in caplog.text
    models.keep_random_start(None)  # the next run starts
    assert models.resolved_start("squeezenet1_1", "imagenet") == "imagenet"
    assert timeouts == [models.FETCH_TIMEOUT_S] * 2 and socket.getdefaulttimeout() is None


def _train_once(root, out, seed, weights=None):
    """One short baseline run; its saved model and the run's folder of checkpoints."""
    import pipeline
    pipeline.run(pipeline.parse_args(
        ["--data-dir", str(root), "--seed", str(seed), "--image-size", "32", "--epochs", "1",
         "--scenarios", "baseline", "--output-dir", str(out), "--no-progress"]
        + (["--weights", str(weights)] if weights else [])))
    run_id = __import__("json").loads((out / "latest_run.json").read_text())["run_id"]
    return out / f"{root.name}_model.pt", out / "checkpoints" / run_id


def test_a_start_that_trained_on_test_images_is_refused_however_it_was_split(tmp_path):
    """A model trained on images this run tests on was let start it unless it was the same
    folder split with another --seed: a --quick run's model, a run's own checkpoint, a model
    of a renamed copy of the folder, or one started from such a model, tested on images it
    had trained on, with no word said. Each trained image is recorded by its bytes now."""
    import shutil
    from conftest import make_folder
    from modules.dataset import index_dataset
    root = make_folder(tmp_path / "d", layout="class folders", n_train=8, n_test=3)
    model, checkpoints = _train_once(root, tmp_path / "out1", seed=1)
    assert (checkpoints / "trained_on.json").exists() and (checkpoints / "baseline.pt").exists()
    other = index_dataset(root, "d", seed=2)
    copied = tmp_path / "elsewhere" / "baseline.pt"  # as the refusal of one in --output-dir says
    copied.parent.mkdir()
    shutil.copyfile(checkpoints / "baseline.pt", copied)
    for start in (model, checkpoints / "baseline.pt", copied):
        with models.pinned_weights_file(start), pytest.raises(
                UserError, match=r"trained on \d+ of this run's \d+ test images \(run \S+, "
                                 r"--seed 1\): their accuracy would read high; pass --seed 1, "
                                 r"or start from other weights\.$"):
            membership.check_start(start, other, 2,
                                   split_with=lambda seed: index_dataset(root, "d", seed=seed))
        with models.pinned_weights_file(start):  # its own split: nothing seen, nothing said
            assert len(membership.check_start(start, index_dataset(root, "d", seed=1), 1).seen) \
                == len(index_dataset(root, "d", seed=1).train)
    # the same images under other names, split by another seed: counted by their bytes
    renamed = tmp_path / "renamed"
    for path in sorted(root.rglob("*.jpg")):
        target = renamed / path.parent.name / f"copy-{path.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    with models.pinned_weights_file(model), pytest.raises(
            UserError, match=r"test images \(run \S+, --seed 1\): their accuracy would read "
                             r"high; start from other weights"):
        membership.check_start(model, index_dataset(renamed, "renamed", seed=2), 2)
    with models.pinned_weights_file(model), pytest.raises(  # seed 1 splits the copy as it did
            UserError, match=r"high; pass --seed 1, or start from other weights"):
        membership.check_start(model, index_dataset(renamed, "renamed", seed=2), 2,
                               split_with=lambda seed: index_dataset(renamed, "r", seed=seed))
    # a model started from it, trained on other images, carries what it had seen
    elsewhere = make_folder(tmp_path / "e", layout="class folders", n_train=6, n_test=2,
                            classes=("red", "green", "blue"))
    for path in elsewhere.rglob("*.jpg"):  # other images: each pixel nudged
        from PIL import Image
        with Image.open(path) as img:
            img.point(lambda v: max(0, v - 1)).save(path.with_suffix(".png"))
        path.unlink()
    carried, _ = _train_once(elsewhere, tmp_path / "out2", seed=1, weights=model)
    with models.pinned_weights_file(carried), pytest.raises(UserError, match="test images"):
        membership.check_start(carried, other, 2)


def test_a_start_carries_its_record_and_older_runs_files_are_said(tmp_path, caplog):
    """A trial's weights copied out of its run's folder are checked as its model is; the
    seed is advised only where it gives the start's split back (not for a start that carried
    images of this folder from a start of its own); a file an earlier version made, which
    noted no images, of this data split otherwise, is said, in its run's folder or copied out,
    and so is every model trained from it."""
    import json
    import shutil
    from conftest import make_folder
    from modules.checkpoints import save_weights
    from modules.dataset import index_dataset
    from modules.results import run_record_beside
    root = make_folder(tmp_path / "d", layout="class folders", n_train=8, n_test=3)
    trained, other = index_dataset(root, "d", seed=1), index_dataset(root, "d", seed=2)
    about = {"run_id": "r1", "seed": 1, "images_fingerprint": trained.images_fingerprint()}
    net = build_model("squeezenet1_1", 3, "none")
    here = membership.of_images(trained.test[:1])  # a test image of seed 1's: in this folder
    for n, (carried, advice) in enumerate(((set(), "pass --seed 1, or "),
                                           ({b"elsewhe."}, "pass --seed 1, or "),
                                           (here, ""))):
        kept = membership.record(tmp_path / f"run-{n}", trained, about,
                                 membership.Start(carried))
        assert (kept["carried"], kept["carried_here"]) == (len(carried), len(carried & here))
        with membership.stamping(kept):
            path = save_weights(net, tmp_path / f"copy-{n}" / "trial.weights.pt")
        assert membership.stamp() == {}  # only while the run trains
        with models.pinned_weights_file(path), pytest.raises(
                UserError, match=rf"test images \(run r1, --seed 1\): their accuracy would "
                                 rf"read high; {advice}start from other weights\.$"):
            membership.check_start(path, other, 2,
                                   split_with=lambda seed: index_dataset(root, "d", seed=seed))
    # an earlier version's run: its record, no images; its checkpoint there and copied out
    folder = tmp_path / "old" / "checkpoints" / "r0"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({
        "run_id": "r0", "dataset": "d", "seed": 1, "data_fingerprint": trained.fingerprint()}))
    old = folder / "baseline.pt"
    torch.save({"format": 1, "config": {"seed": 1}, "model": net.state_dict()}, old)
    copied = tmp_path / "old-copy.pt"
    shutil.copyfile(old, copied)
    warned = "which an earlier version made without noting the images it trained on, was " \
             "split otherwise than this run's data"
    for start, index, said in ((old, trained, False), (old, other, True),
                               (copied, trained, False), (copied, other, True)):
        caplog.clear()
        with models.pinned_weights_file(start), caplog.at_level(logging.WARNING):
            begun = membership.check_start(start, index, index is trained and 1 or 2,
                                           run_record_beside(start))
        assert (warned in caplog.text) == said and (begun.unrecorded is not None) == said
    assert "old-copy.pt (a checkpoint, --seed 1)" in caplog.text
    # a model trained from it says so too, wherever it goes
    kept = membership.record(tmp_path / "run-from-old", other, about, begun)
    with membership.stamping(kept):
        child = save_weights(net, tmp_path / "child" / "trial.weights.pt")
    caplog.clear()
    with models.pinned_weights_file(child), caplog.at_level(logging.WARNING):
        assert membership.check_start(child, other, 2).unrecorded == begun.unrecorded
    assert f"was trained from {copied} (a checkpoint, --seed 1), which an earlier version" \
        in caplog.text


def test_a_quick_models_seed_is_advised_where_it_splits_as_the_model_saw(tmp_path,
                                                                         monkeypatch):
    """A --quick run's model trains on a subset, whose fingerprint is never the folder's, so a
    full run of another --seed refused it without advising the model's seed, which splits the
    folder so that the subset's training images are training images again. The advice is now
    found by splitting the images with that seed."""
    import json
    import shutil
    import pipeline
    import scenario
    from conftest import make_folder
    from modules.dataset import index_dataset
    monkeypatch.setattr(scenario, "QUICK_PER_CLASS", {"train": 4, "val": 2, "test": 2})
    root = make_folder(tmp_path / "d", layout="class folders", n_train=8, n_test=3)
    out = tmp_path / "out"
    argv = ["--data-dir", str(root), "--image-size", "32", "--epochs", "1", "--scenarios",
            "baseline", "--output-dir", str(out), "--no-progress"]
    pipeline.run(pipeline.parse_args([*argv, "--quick", "--seed", "1"]))
    model = tmp_path / "quick.pt"  # a copy: the output dir's own may be replaced by a run
    shutil.copyfile(out / "d_model.pt", model)
    run_id = json.loads((out / "latest_run.json").read_text())["run_id"]
    kept = json.loads((out / "checkpoints" / run_id / membership.FILE_NAME).read_text())
    assert kept["quick"] and \
        kept["images_fingerprint"] != index_dataset(root, "d", seed=1).images_fingerprint()
    with pytest.raises(UserError, match=r"test images \(run \S+, --seed 1, --quick\): their "
                                        r"accuracy would read high; pass --seed 1, or start "
                                        r"from other weights\.$"):
        pipeline.run(pipeline.parse_args([*argv, "--seed", "2", "--weights", str(model)]))
    # as advised: its training images are training images again, and the run starts
    pipeline.run(pipeline.parse_args([*argv, "--seed", "1", "--weights", str(model)]))
    assert json.loads((out / "latest_run.json").read_text())["run_id"] != run_id


def test_a_resume_with_another_start_is_refused_for_that_first(tmp_path):
    """--resume --weights M --seed S, where M is not what the run started from, was refused for
    the images M had seen, advising another --seed, which the resume then refused: the two
    refusals sent the user round in a circle, and neither named the real change."""
    import pipeline
    from conftest import make_folder
    root = make_folder(tmp_path / "d", layout="class folders", n_train=8, n_test=3)
    seven, _ = _train_once(root, tmp_path / "out7", seed=7)
    out = tmp_path / "out1"
    _train_once(root, out, seed=1)
    argv = ["--data-dir", str(root), "--seed", "1", "--image-size", "32", "--epochs", "1",
            "--scenarios", "baseline", "--output-dir", str(out), "--no-progress", "--resume",
            "--weights", str(seven)]
    with pytest.raises(UserError) as refused:
        pipeline.run(pipeline.parse_args(argv))
    assert "--weights" in str(refused.value) and "trained on" not in str(refused.value)
    # without --resume, refused before the run begins: nothing of it is left
    fresh = tmp_path / "fresh"
    with pytest.raises(UserError, match="trained on"):
        pipeline.run(pipeline.parse_args([*argv[:11], str(fresh), "--no-progress",
                                          "--weights", str(seven)]))
    assert not (fresh / "checkpoints").exists() and not (fresh / "latest_run.json").exists()


def test_a_start_that_trained_on_validation_images_is_said(tmp_path, caplog):
    """Where test/ is the folder's, a start trained on some of this run's validation images
    (another split of the same train/) is let start, with the count said."""
    import json
    from conftest import make_folder
    from modules.dataset import index_dataset
    root = make_folder(tmp_path / "d", layout="train/test", n_train=8, n_test=3)
    trained, now = index_dataset(root, "d", seed=1), index_dataset(root, "d", seed=2)
    folder = tmp_path / "checkpoints" / "r1"
    membership.record(folder, trained, {"run_id": "r1", "seed": 1, "quick": True,
                                        "images_fingerprint": "a subset's"})
    assert json.loads((folder / membership.FILE_NAME).read_text())["images"] == \
        len(trained.train)
    start = folder / "baseline.pt"
    torch.save({"state_dict": build_model("squeezenet1_1", 3, "none").state_dict()}, start)
    seen = len({p for p, _ in now.val} & {p for p, _ in trained.train})
    assert seen > 0
    with models.pinned_weights_file(start), caplog.at_level(logging.WARNING):
        membership.check_start(start, now, 2)
    assert f"trained on {seen} of this run's {len(now.val)} validation images (run r1, " \
           "--seed 1, --quick): validation, which picks epochs and settings, reads high; the " \
           "test images are new to it." in caplog.text


def test_what_is_said_of_the_start_is_in_the_run_log(tmp_path):
    """The warning that a start trained on this run's validation images (so validation, and
    the val_acc the best model is kept by, reads high) went to the console only: the check
    runs before the run has an id, and run.log opens after."""
    import json
    from conftest import make_folder
    root = make_folder(tmp_path / "d", layout="train/test", n_train=8, n_test=3)
    model, _ = _train_once(root, tmp_path / "out1", seed=1)
    out = tmp_path / "out2"
    _train_once(root, out, seed=2, weights=model)
    run_id = json.loads((out / "latest_run.json").read_text())["run_id"]
    text = (out / "runs" / run_id / "run.log").read_text()
    assert "modules.membership: --weights" in text  # level names as setup_logging sets them
    assert "validation, which picks epochs and settings, reads high" in text


@pytest.mark.parametrize("layout", ["class folders", "train/test"])
def test_a_start_model_of_these_images_split_otherwise_is_refused_or_said(tmp_path, layout,
                                                                           caplog):
    """The tool's own model, saved by a run with another --seed, started a run whose test
    images it had trained on: 66.7% on random labels, chance 33%, with no word said."""
    from conftest import make_folder
    from modules.dataset import index_dataset
    from modules.model_files import save_model
    root = make_folder(tmp_path / "d", layout=layout, n_train=8, n_test=3)
    trained = index_dataset(root, "d", seed=1)
    path = save_model(build_model("squeezenet1_1", 3, "none"), tmp_path / "d_model.pt",
                      arch="squeezenet1_1", class_names=trained.classes, image_size=32,
                      extra={"data_fingerprint": trained.fingerprint(), "run_id": "r1",
                             "images_fingerprint": trained.images_fingerprint(), "seed": 1})
    with models.pinned_weights_file(path):
        membership.check_start(path, trained)  # its own split: nothing to say
        assert not caplog.records
        other = index_dataset(root, "d", seed=2)
        if layout == "class folders":  # the seed draws the test split
            with pytest.raises(UserError, match=r"model of these images split with another "
                                                r"--seed: it trained on some of this run's "
                                                r"test images.*pass --seed 1 of run r1"):
                membership.check_start(path, other, 2)
            # split otherwise with the seed given: passing it again would not help
            with pytest.raises(UserError, match=r"split otherwise \(with --quick, or before "
                                                r"a file .*; start from other weights\.$"):
                membership.check_start(path, other, 1)
        else:
            with caplog.at_level(logging.WARNING):
                membership.check_start(path, other)
            assert "some of this run's validation images" in caplog.text
            assert "test/ is unchanged. --seed 1 of run r1 splits them" in caplog.text
    if layout == "class folders":  # and the run says so before it trains
        import pipeline
        args = pipeline.parse_args(["--data-dir", str(root), "--seed", "2", "--weights",
                                    str(path), "--image-size", "32", "--epochs", "1",
                                    "--scenarios", "baseline", "--output-dir",
                                    str(tmp_path / "out")])
        with pytest.raises(UserError, match="split with another --seed"):
            pipeline.run(args)
