"""Out-of-memory recovery (smaller micro-batches, same effective batch) and the optimizer-impl
and cpu_threads knobs. CPU tests simulate the OOM; one GPU test makes a real one."""
from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import modules.trainer as trainer
from modules.config import TrainConfig, UserError
from modules.dataset import EpochSampler
from modules.device import apply_process_settings
from modules.models import build_model
from modules.trainer import make_optimizer, set_seed, train
from modules.utility import evaluate
from test_trainer import TinyNet

BASE = TrainConfig(model="squeezenet1_1", weights="none", image_size=32, epochs=2, batch_size=16,
                   grad_accum_steps=2, lr=0.01, optimizer="sgd", scheduler="cosine",
                   device="cpu", progress=False, seed=0)
N_TRAIN = 48


class RunsOutAbove(nn.Module):
    """Trains like `inner`, but a training forward of more than `limit` samples raises the
    error CUDA raises, once `after` training forwards have gone through."""

    def __init__(self, inner: nn.Module, limit: float, after: int = 0,
                 error=lambda: torch.OutOfMemoryError("CUDA out of memory (simulated)"),
                 eval_limit: float = math.inf):
        super().__init__()
        self.inner, self.limit, self.after, self.error = inner, limit, after, error
        self.eval_limit = eval_limit  # the same for an evaluation forward
        self.num_classes = inner.num_classes
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if x.shape[0] > self.limit and self.calls > self.after:
                raise self.error()
        elif x.shape[0] > self.eval_limit:
            raise self.error()
        return self.inner(x)


def data(n: int, size: int, seed: int = 0) -> TensorDataset:
    """Class k has a brighter channel k."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 3, size, size, generator=g) * 0.5
    x[torch.arange(n), y] += 1.0
    return TensorDataset(x, y)


def squeezenet() -> nn.Module:
    model = build_model("squeezenet1_1", 3, "none")
    # Dropout draws from the RNG per element: chunked batches would draw differently.
    model.classifier[0] = nn.Identity()
    return model


def run(config=BASE, limit=math.inf, after=0, make=squeezenet, train_data=None, **wrap):
    set_seed(config.seed)
    model = RunsOutAbove(make(), limit, after, **wrap)
    train_data = train_data or data(N_TRAIN, config.image_size)
    val = data(12, config.image_size, seed=1)
    return train(model, DataLoader(train_data, batch_size=config.batch_size,
                                   sampler=EpochSampler(len(train_data), config.seed)),
                 DataLoader(val, batch_size=config.batch_size), config)


def oom_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "modules.trainer" and r.levelno == logging.WARNING
            and "out of memory" in r.getMessage()]


@pytest.fixture(scope="module")
def reference():
    """The same run with memory to spare."""
    return run()


@pytest.mark.parametrize("limit, after, recoveries", [
    (4, 0, 2),   # the first forward fails; 16 -> 8 -> 4
    (8, 1, 1),   # the first batch of a window goes through at 16, the second fails: replay both
])
def test_oom_halves_the_micro_batch_and_trains_like_a_run_with_memory(
        reference, monkeypatch, caplog, limit, after, recoveries):
    caplog.set_level(logging.WARNING, logger="modules.trainer")
    result = run(limit=limit, after=after)
    settings = result.settings
    assert (settings["micro_batch_size"], settings["oom_recoveries"],
            settings["effective_batch_size"]) == (limit, recoveries, 32)
    assert reference.settings["oom_recoveries"] == 0
    assert reference.settings["micro_batch_size"] == 16
    # every sample counted once per epoch, though a window went through twice
    assert [row["samples"] for row in result.history] == [N_TRAIN, N_TRAIN]
    assert result.timing["samples"] == reference.timing["samples"]
    for got, want in zip(result.history, reference.history):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
        assert got["train_acc"] == want["train_acc"]
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-4)
    # the same samples per optimizer step, weighted the same: the same weights
    for (name, got), want in zip(result.model.state_dict().items(),
                                 reference.model.state_dict().values()):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), name
    warnings = oom_warnings(caplog)
    assert len(warnings) == recoveries
    assert warnings[0] == ("out of memory at micro-batch 16 (32 px); continuing with micro-batch "
                           "8 and 2x more accumulation: the effective batch stays 32")


def test_an_oom_split_leaves_no_lone_sample_for_batchnorm():
    """A batch of 10 in pieces of 3 was cut 3, 3, 3, 1: resnet18's last BatchNorm at 32 px
    sees 1x1 maps, and one sample there is a ValueError traceback in train mode."""
    config = dataclasses.replace(BASE, model="resnet18", batch_size=10, grad_accum_steps=1,
                                 epochs=1)
    result = run(config, limit=4, make=lambda: build_model("resnet18", 3, "none"),
                 train_data=data(40, config.image_size))
    assert result.settings["micro_batch_size"] == 3 and result.history[0]["samples"] == 40


def test_the_report_says_a_scenario_went_on_in_micro_batches():
    from modules.report import render_report
    settings = {"batch_size": 16, "micro_batch_size": 4, "oom_recoveries": 2}
    text = render_report([{"scenario": "baseline", "settings": settings}], [])
    assert "Ran out of memory in training 2x and went on in micro-batches of 4 images." in text
    settings.update(micro_batch_size=16, oom_recoveries=0)
    assert "Ran out of memory" not in render_report([{"scenario": "baseline",
                                                       "settings": settings}], [])


def test_oom_with_one_sample_per_pass_is_a_one_line_user_error(caplog):
    caplog.set_level(logging.WARNING, logger="modules.trainer")
    with pytest.raises(UserError) as err:
        run(dataclasses.replace(BASE, batch_size=4, grad_accum_steps=1), limit=0)
    message = str(err.value)
    assert "\n" not in message and "out of memory" in message and "--image-size" in message
    # still an OOM to code that skips candidates which do not fit (the Optuna tuner)
    assert isinstance(err.value, torch.OutOfMemoryError)
    assert len(oom_warnings(caplog)) == 2  # 4 -> 2 -> 1, then nothing smaller


def test_evaluation_out_of_memory_goes_on_in_smaller_pieces_with_the_same_figures(
        reference, caplog):
    caplog.set_level(logging.WARNING, logger="modules.evaluation")
    result = run(eval_limit=4)  # validation batches of 12: 12 -> 6 -> 3 images per piece
    for got, want in zip(result.history, reference.history):
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
        assert got["val_acc"] == want["val_acc"]
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    halvings = [r.getMessage() for r in caplog.records if r.name == "modules.evaluation"]
    assert halvings[:2] == ["out of memory evaluating batches of 12; continuing in pieces of 6",
                            "out of memory evaluating batches of 6; continuing in pieces of 3"]
    # found once: later epochs' validation starts in the pieces the first one needed
    assert BASE.epochs == 2 and len(halvings) == 2

    model = RunsOutAbove(squeezenet(), math.inf, eval_limit=0)
    model.train()
    with pytest.raises(UserError) as err:
        evaluate(model, DataLoader(data(4, 32), batch_size=4), device="cpu")
    message = str(err.value)
    assert "\n" not in message and "out of memory" in message and "32 px" in message
    assert isinstance(err.value, torch.OutOfMemoryError) and model.training  # mode restored


def test_cpu_cublas_and_cudnn_allocation_failures_are_out_of_memory():
    from modules.oom import is_out_of_memory
    assert is_out_of_memory(RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"))
    # cuBLAS and cuDNN failing to allocate their workspace
    assert is_out_of_memory(RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_an_older_torch_oom_runtime_error_is_recovered_and_other_errors_are_not():
    config = dataclasses.replace(BASE, epochs=1)
    result = run(config, limit=8, make=lambda: TinyNet(),
                 error=lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert (result.settings["oom_recoveries"], result.settings["micro_batch_size"]) == (1, 8)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run(config, limit=8, make=lambda: TinyNet(), error=lambda: RuntimeError("shape mismatch"))


def test_the_nonfinite_guard_works_on_chunked_batches():
    config = dataclasses.replace(BASE, image_size=24, epochs=2)
    poisoned = data(N_TRAIN, 24)
    poisoned.tensors[0][5] = float("nan")  # one sample: one bad chunk in one batch per epoch
    result = run(config, limit=4, make=lambda: TinyNet(), train_data=poisoned)
    assert result.settings["oom_recoveries"] == 2 and result.nonfinite_steps == 2
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    assert all(math.isfinite(r["train_loss"]) for r in result.history)

    broken = data(N_TRAIN, 24)
    broken.tensors[0][:] = float("inf")
    with pytest.raises(trainer.DivergedError, match="diverged"):
        run(dataclasses.replace(config, max_nonfinite_steps=2), limit=4, make=lambda: TinyNet(),
            train_data=broken)


class FailsAfterItsNorm(TinyNet):
    """BatchNorm, then the error CUDA raises, once, on the `at`-th training forward of a whole
    batch: the failed pass has already moved the running statistics."""

    def __init__(self, at: int):
        super().__init__()
        self.norm, self.at, self.calls = nn.BatchNorm2d(4), at, 0

    def forward(self, x):
        h = torch.relu(self.norm(self.conv(x)))
        if self.training and x.shape[0] == 8:
            self.calls += 1
            if self.calls == self.at:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.fc(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("accum, trained_forwards", [
    (1, 1 + 3 * 2),  # batch 1 whole; the failed batch 2 and batches 3-4 in halves
    (2, 4 + 4),      # batch 2 fails: its window is replayed in halves, then window 2
])
def test_an_oom_replay_leaves_batchnorm_as_if_only_the_replay_ran(accum, trained_forwards,
                                                                   caplog):
    caplog.set_level(logging.WARNING, logger="modules.trainer")
    config = dataclasses.replace(BASE, model="resnet18", image_size=16, epochs=1, batch_size=8,
                                 grad_accum_steps=accum)
    set_seed(0)
    model = FailsAfterItsNorm(at=2)
    result = train(model, DataLoader(data(32, 16), batch_size=8),
                   DataLoader(data(12, 16, seed=1), batch_size=8), config)
    assert result.settings["oom_recoveries"] == 1
    assert model.norm.num_batches_tracked.item() == trained_forwards
    # the effective batch stays, but what BatchNorm normalises by does not
    assert oom_warnings(caplog)[0].endswith(
        f"the effective batch stays {8 * accum}; its BatchNorm statistics are now computed per "
        "micro-batch of 4 images")


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("impl, flags", [("auto", {"fused": None, "foreach": None}),
                                         ("fused", {"fused": True}),
                                         ("foreach", {"foreach": True}),
                                         ("forloop", {"foreach": False})])
def test_optimizer_impl_builds_on_cpu(optimizer, impl, flags):
    config = dataclasses.replace(BASE, optimizer=optimizer, optimizer_impl=impl)
    built = make_optimizer(TinyNet(), config, torch.device("cpu"))
    assert {k: built.defaults.get(k) for k in flags} == flags


def test_optimizer_impls_train_alike(monkeypatch):
    import modules.trainer
    built = []
    real = modules.trainer.make_optimizer
    monkeypatch.setattr(modules.trainer, "make_optimizer", lambda *args: built.append(
        real(*args)) or built[-1])
    config = dataclasses.replace(BASE, image_size=24, epochs=1, optimizer="adamw")
    runs = [run(dataclasses.replace(config, optimizer_impl=impl), make=lambda: TinyNet())
            for impl in ("forloop", "foreach", "fused")]
    # each run trained with the kernels asked for: runs that all ignored them would match too
    assert [(o.defaults.get("foreach"), o.defaults.get("fused")) for o in built] == \
        [(False, None), (True, None), (None, True)]
    for other in runs[1:]:
        for got, want in zip(other.model.parameters(), runs[0].model.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unsupported_fused_optimizer_is_a_one_line_user_error(monkeypatch):
    optim_module = importlib.import_module("torch.optim.optimizer")  # fused devices live here
    if not hasattr(optim_module, "_get_fused_kernels_supported_devices"):
        pytest.skip("this torch has no fused-device list to patch")
    monkeypatch.setattr(optim_module, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    config = dataclasses.replace(BASE, optimizer="adam", optimizer_impl="fused")
    with pytest.raises(UserError, match="fused is not supported for adam") as err:
        make_optimizer(TinyNet(), config, torch.device("cpu"))
    assert "\n" not in str(err.value)


def test_cpu_threads_is_applied_by_the_caller_and_recorded():
    before = torch.get_num_threads()
    config = dataclasses.replace(BASE, image_size=24, epochs=1)
    one = dataclasses.replace(config, cpu_threads=1)
    try:
        # train() leaves the process as it finds it; the caller applies the settings (fit does)
        assert run(one, make=lambda: TinyNet()).settings["cpu_threads"] == before
        apply_process_settings(one, torch.device("cpu"))
        result = run(one, make=lambda: TinyNet())
        assert result.settings["cpu_threads"] == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert run(config, make=lambda: TinyNet()).settings["cpu_threads"] == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_oom_is_recovered():
    """Cap this process's GPU memory so that 64 images at 224 px do not fit but 16 do."""
    config = TrainConfig(model="squeezenet1_1", weights="none", image_size=224, epochs=1,
                         batch_size=64, lr=0.01, optimizer="sgd", scheduler="none",
                         device="cuda", amp="off", cudnn_benchmark=False, progress=False, seed=0)

    def train_at(batch_size: int, n: int):
        cfg = dataclasses.replace(config, batch_size=batch_size)
        set_seed(cfg.seed)
        loader = DataLoader(data(n, cfg.image_size), batch_size=batch_size)
        return train(squeezenet(), loader, DataLoader(data(8, cfg.image_size), batch_size=8), cfg)

    def peak_reserved(batch_size: int) -> int:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        train_at(batch_size, batch_size)
        return torch.cuda.max_memory_reserved()

    small, larger = peak_reserved(8), peak_reserved(16)
    per_sample = max(1, (larger - small) / 8)
    static = small - 8 * per_sample
    limit = static + 24 * per_sample  # 64 and 32 do not fit; 16 does
    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    try:
        torch.cuda.set_per_process_memory_fraction(limit / total, 0)
        with pytest.raises(torch.OutOfMemoryError):  # the cap does bite
            torch.empty(int(limit) + (64 << 20), dtype=torch.uint8, device="cuda")
        result = train_at(64, 128)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        gc.collect()
        torch.cuda.empty_cache()
    measured = f"peaks {small >> 20} MiB at 8, {larger >> 20} MiB at 16; cap {int(limit) >> 20} MiB"
    assert result.settings["oom_recoveries"] >= 1, measured
    assert result.settings["micro_batch_size"] <= 32
    assert result.settings["effective_batch_size"] == 64
    assert result.timing["samples"] == 128 and math.isfinite(result.history[0]["train_loss"])
