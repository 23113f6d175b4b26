"""Each trainer feature does what it says, on tiny in-memory data (CPU, seconds)."""
from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

from modules.config import TrainConfig, UserError
from modules.dataset import EpochSampler
from modules.checkpoints import load_checkpoint
from modules.device import autocast_dtype
from modules.trainer import (METRIC_BATCHES, TIMING_WARMUP_STEPS, DivergedError, Progress,
                             make_optimizer, make_scheduler,
                             set_seed, train)

BASE = TrainConfig(model="resnet18", weights="none", image_size=16, epochs=3, batch_size=8,
                   lr=0.05, optimizer="sgd", scheduler="none", device="cpu", progress=False,
                   seed=0)


class TinyNet(nn.Module):
    """Small and BatchNorm-free, so micro-batching is exactly equivalent to one big batch."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.num_classes = num_classes
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def colour_data(n: int = 48, seed: int = 0, shift: int = 0) -> TensorDataset:
    """Class k has a bright channel k; `shift` relabels, to make a deliberately wrong val set."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 3, 16, 16, generator=g) * 0.5
    x[torch.arange(n), y] += 1.0
    return TensorDataset(x, (y + shift) % 3)


def loader(data, config, train=True):
    return DataLoader(data, batch_size=config.batch_size,
                      sampler=EpochSampler(len(data), config.seed) if train else None)


class Interrupted(Exception):
    """Raised from an epoch hook: the run stops there, as Ctrl-C would."""


def interrupt_after(stop_epoch: int):
    """An on_epoch hook that raises Interrupted after epoch `stop_epoch` (1-based)."""
    def hook(epoch, _row):
        if epoch == stop_epoch:
            raise Interrupted
    return hook


def fit(config=BASE, train_data=None, val_data=None, **kwargs):
    set_seed(config.seed)
    model = TinyNet()
    train_data = train_data or colour_data()
    val_data = val_data or colour_data(24, seed=1)
    return train(model, loader(train_data, config), loader(val_data, config, False), config,
                 **kwargs)


def test_learns_and_records_history():
    result = fit(dataclasses.replace(BASE, epochs=4))
    assert result.best_val_acc > 0.8
    assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]
    row = result.history[-1]
    assert {"train_loss", "train_acc", "val_loss", "val_acc", "lr", "epoch_s",
            "samples_per_s"} <= set(row)
    # the first steps (CUDA context, cuDNN autotuning) are left out of the timing figures
    assert row["samples_per_s"] > 0 and result.timing["steps"] == 4 * 6 - TIMING_WARMUP_STEPS
    assert 0 <= result.timing["data_wait_frac"] < 1


@pytest.mark.parametrize("val", [[], None])
def test_an_empty_or_missing_validation_loader_is_one_line(val):
    """train() without validation batches reported best_val_acc 0.0 at epoch 0, figures that
    read as measured, and a None loader raised a TypeError."""
    with pytest.raises(UserError, match="the validation split is empty"):
        train(TinyNet(), loader(colour_data(), BASE), val, BASE)


def test_progress_bars_cover_training_and_validation(capsys):
    """A validation pass (or a test pass: 16 s for Intel's 3,000 test images on a CPU) is not
    silence after the training bar; with progress off, nothing is drawn."""
    fit(dataclasses.replace(BASE, epochs=2, progress=True))
    drawn = capsys.readouterr().err
    assert all(f"{bar}:" in drawn for bar in ("epoch 2/2", "validation 1/2", "validation 2/2"))
    fit(dataclasses.replace(BASE, epochs=1))
    drawn = capsys.readouterr().err
    assert "epoch 1/1:" not in drawn and "validation 1/1:" not in drawn


def test_an_evaluation_draws_from_torch_s_generator_as_its_loader_alone_does():
    """tqdm(loader) takes a draw of its own from torch's generator (a DataLoader's seed): an
    evaluation bar wrapping the loader made every later epoch's shuffles and augmentations
    differ, and the quick baseline end at 39.3% where it had 41.8%, bars shown or not."""
    from modules.evaluation import evaluate
    model, data = TinyNet().eval(), loader(colour_data(24, 1), BASE, False)
    torch.manual_seed(0)
    list(data)
    plain = torch.get_rng_state()
    for progress in (None, "validation 1/1"):
        torch.manual_seed(0)
        evaluate(model, data, num_classes=3, progress=progress)
        assert torch.equal(torch.get_rng_state(), plain), progress


def test_progress_bars_are_drawn_by_one_process(capsys, monkeypatch):
    """Under torchrun every rank drew its bars on one console (the final runs' configuration
    is rank 0's, sent to all), where the logs are rank 0's alone."""
    from modules import distributed
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    fit(dataclasses.replace(BASE, epochs=1, progress=True))
    drawn = capsys.readouterr().err
    assert "epoch 1/1:" not in drawn and "validation 1/1:" not in drawn


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one
def test_ctrl_c_dropped_by_python_in_a_weakref_callback_still_stops_the_run():
    """Ctrl-C landing in a weakref callback (a library's cache entry dropped as tensors are
    freed) raised its KeyboardInterrupt there, where Python prints "Exception ignored" and
    goes on: a reviewer's Stop was lost 2 times in 7, and the run trained to its end. The
    press is remembered and the next batch stops."""
    import signal
    import weakref
    from modules import interrupts

    class Dropping(TinyNet):
        calls = 0

        def forward(self, x):
            Dropping.calls += 1
            if Dropping.calls == 2:
                holder = type("Holder", (), {})()
                self.ref = weakref.ref(holder, lambda _: signal.raise_signal(signal.SIGINT))
                del holder  # the callback runs here, and Python drops what it raises
            return super().forward(x)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with interrupts.stoppable(), pytest.raises(KeyboardInterrupt):
            train(Dropping(), loader(colour_data(), BASE), loader(colour_data(24, 1), BASE, False),
                  dataclasses.replace(BASE, epochs=1))
        assert Dropping.calls == 2  # stopped at the next batch, not after the epoch
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        interrupts.check()  # nothing remembered once the run has ended
    finally:
        signal.signal(signal.SIGINT, previous)


def test_accumulation_matches_one_large_batch():
    data = colour_data(32)
    one = dataclasses.replace(BASE, epochs=1, batch_size=32, grad_accum_steps=1)
    four = dataclasses.replace(BASE, epochs=1, batch_size=8, grad_accum_steps=4)
    a, b = fit(one, data), fit(four, data)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_clipping_bounds_the_gradient_norm():
    norms = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
    handle = register_optimizer_step_pre_hook(record)
    try:
        fit(dataclasses.replace(BASE, epochs=1, lr=1.0, max_grad_norm=0.01))
        clipped = list(norms)
        norms.clear()
        fit(dataclasses.replace(BASE, epochs=1, lr=1.0))
    finally:
        handle.remove()
    assert max(clipped) <= 0.01 * 1.0001
    assert max(norms) > 0.05  # without clipping the same run has larger gradients


def test_a_resume_keeps_its_own_optimizer_kernel_not_the_checkpoints(tmp_path):
    """The kernel is a speed setting of this run (the autotuner's, or --optimizer-impl): a
    checkpoint's must not come back with its optimizer state (a GPU's fused one on a CPU)."""
    config = dataclasses.replace(BASE, epochs=2, optimizer="adamw")
    with pytest.raises(Interrupted):
        fit(dataclasses.replace(config, optimizer_impl="foreach"),
            checkpoint_path=tmp_path / "ck.pt", on_epoch=interrupt_after(1))
    kernels = []
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: kernels.append(optimizer.param_groups[0]["foreach"]))
    try:
        resumed = fit(dataclasses.replace(config, optimizer_impl="forloop"),
                      checkpoint_path=tmp_path / "ck.pt", resume=True)
    finally:
        handle.remove()
    assert resumed.resumed_from_epoch == 1 and kernels and set(kernels) == {False}


def test_a_resume_applies_its_own_early_stopping_patience(tmp_path):
    """A run that had stopped early trained nothing when resumed with a longer patience (or
    none), and said nothing; one resumed with a patience it has already waited out stops."""
    config = dataclasses.replace(BASE, epochs=8, early_stopping_patience=2)
    shifted = colour_data(24, seed=1, shift=1)  # val worsens as train improves: stops early
    ck = tmp_path / "ck.pt"
    stopped = fit(config, val_data=shifted, checkpoint_path=ck)
    assert stopped.stopped_early and stopped.epochs_run < 8
    longer = fit(dataclasses.replace(config, early_stopping_patience=None), val_data=shifted,
                 checkpoint_path=ck, resume=True)
    assert longer.resumed_from_epoch == stopped.epochs_run and longer.epochs_run == 8
    assert longer.history[:stopped.epochs_run] == stopped.history
    with pytest.raises(Interrupted):  # 2 epochs in, one of them without a better val accuracy
        fit(dataclasses.replace(config, early_stopping_patience=3), val_data=shifted,
            checkpoint_path=tmp_path / "part.pt", on_epoch=interrupt_after(2))
    shorter = fit(dataclasses.replace(config, early_stopping_patience=1), val_data=shifted,
                  checkpoint_path=tmp_path / "part.pt", resume=True)
    assert shorter.epochs_run == 2 and shorter.stopped_early


def test_early_stopping_restores_the_best_weights():
    snapshots = {}
    config = dataclasses.replace(BASE, epochs=12, early_stopping_patience=2)
    model_ref = {}

    def on_epoch(epoch, metrics):
        snapshots[epoch] = {k: v.clone() for k, v in model_ref["m"].state_dict().items()}

    # The val labels are shifted, so the better the model fits train, the worse val gets.
    set_seed(0)
    model_ref["m"] = model = TinyNet()
    result = train(model, loader(colour_data(), config),
                   loader(colour_data(24, seed=1, shift=1), config, False), config, on_epoch=on_epoch)
    assert result.stopped_early and result.epochs_run < 12
    accs = [r["val_acc"] for r in result.history]
    assert result.best_epoch == 1 + accs.index(max(accs)) < result.epochs_run
    for k, v in result.model.state_dict().items():
        torch.testing.assert_close(v, snapshots[result.best_epoch][k])
    # the time to the kept model is to its epoch, not to the run's end
    assert result.time_to_best_s == result.history[result.best_epoch - 1]["elapsed_s"] \
        < result.history[-1]["elapsed_s"]


def test_early_stopping_stops_exactly_patience_epochs_after_the_best():
    """--early-stopping 2 means two epochs without a better validation accuracy, then
    stop: a third would spend an epoch of a tuning trial for nothing."""
    config = dataclasses.replace(BASE, epochs=12, early_stopping_patience=2)
    result = fit(config, val_data=colour_data(24, seed=1, shift=1))
    assert result.stopped_early
    assert result.epochs_run == result.best_epoch + config.early_stopping_patience


def test_a_tied_validation_accuracy_is_not_a_new_best():
    """A plateau must run out the patience: a tie that counted as better would restart it
    every epoch (the run never stops) and move the best epoch to a later, no better one."""
    progress, model = Progress(), TinyNet()
    stops = [progress.record({"epoch": e, "val_acc": 0.5, "elapsed_s": 0.0}, model, patience=2)
             for e in (1, 2, 3)]
    assert stops == [False, False, True]
    assert progress.best["epoch"] == 1 and progress.best["acc"] == 0.5


def test_a_planted_nan_loss_is_skipped_and_counted():
    data = colour_data()
    data.tensors[0][5] = float("nan")  # poisons exactly one batch per epoch
    result = fit(dataclasses.replace(BASE, epochs=2), data)
    assert result.nonfinite_steps == 2
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    assert math.isfinite(result.history[-1]["train_loss"]) and result.best_val_acc > 0.6


def test_occasional_nan_batches_separated_by_updates_never_add_up_to_a_divergence():
    """An applied update ends a run of bad batches: one NaN batch an epoch, over more epochs
    than max_nonfinite_steps, is a few skipped steps in a healthy run, not a divergence."""
    data = colour_data()
    data.tensors[0][5] = float("nan")  # one batch an epoch, each time between finite ones
    result = fit(dataclasses.replace(BASE, epochs=4, max_nonfinite_steps=3), data)
    assert result.epochs_run == 4 and result.nonfinite_steps == 4
    assert math.isfinite(result.history[-1]["train_loss"]) and result.best_val_acc > 0.6


def test_train_accuracy_counts_each_committed_batch_once_across_held_groups():
    """Correct predictions are counted METRIC_BATCHES batches at a time: the epoch's figure is
    the one counting every batch as it came gives, the NaN batch that was skipped left out."""
    config = dataclasses.replace(BASE, epochs=2, batch_size=2)
    data = colour_data()
    data.tensors[0][5] = float("nan")
    batches = loader(data, config)
    assert len(batches) > METRIC_BATCHES  # one full group counted mid-epoch, the rest at its end

    class Recording:  # the loader, noting each training batch's labels as the trainer takes it
        sampler = batches.sampler

        def __len__(self):
            return len(batches)

        def __iter__(self):
            for x, y in batches:
                labels.append(y)
                yield x, y

    labels, predicted = [], []
    set_seed(config.seed)
    model = TinyNet()
    model.register_forward_hook(lambda m, _, out: predicted.append(out.detach()) if m.training
                                else None)
    result = train(model, Recording(), loader(colour_data(24, seed=1), config, False), config)
    per_epoch = len(batches)
    for epoch, row in enumerate(result.history):
        pairs = list(zip(predicted[epoch * per_epoch:(epoch + 1) * per_epoch],
                         labels[epoch * per_epoch:(epoch + 1) * per_epoch]))
        kept = [(out, y) for out, y in pairs if torch.isfinite(out).all()]
        assert len(kept) == per_epoch - 1  # the poisoned batch
        correct = sum(int((out.argmax(1) == y).sum()) for out, y in kept)
        assert row["train_acc"] == correct / sum(len(y) for _, y in kept)


def test_a_diverging_run_stops_with_a_clear_message():
    data = colour_data()
    data.tensors[0][:] = float("inf")
    with pytest.raises(DivergedError, match=r"diverged.*lower --lr") as err:
        fit(dataclasses.replace(BASE, max_nonfinite_steps=3), data)
    assert isinstance(err.value, UserError) and "\n" not in str(err.value)
    # a small set: two batches an epoch, fewer than the limit; the count goes on across epochs
    small = colour_data(16)
    small.tensors[0][:] = float("inf")
    with pytest.raises(DivergedError, match=r"3 batches with no update .* up to epoch 2"):
        fit(dataclasses.replace(BASE, epochs=4, batch_size=8, max_nonfinite_steps=3), small)


def test_a_model_retried_after_a_divergence_starts_from_clean_gradients():
    """A notebook user retrying on the same model after "training diverged": its NaN gradients
    stayed on the parameters, and the clean retry added them to its first window."""
    config = dataclasses.replace(BASE, epochs=2, batch_size=8, max_nonfinite_steps=2)
    torch.manual_seed(0)
    model = TinyNet()
    bad = colour_data(40)
    bad.tensors[0][:] = float("nan")
    val = loader(colour_data(12), config, False)
    with pytest.raises(DivergedError):
        train(model, loader(bad, config), val, config)
    result = train(model, loader(colour_data(40), config), val, config)
    assert result.nonfinite_steps == 0 and all(torch.isfinite(p).all()
                                               for p in model.parameters())


class Normed(TinyNet):
    """TinyNet with a BatchNorm, whose running statistics move in the forward pass."""
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


def test_a_divergence_leaves_batchnorms_statistics_finite_for_a_retry():
    """The window that stopped the run had moved BatchNorm's running statistics to NaN: a
    retry on the same model then validated every epoch at 0% with a NaN loss, as a result."""
    config = dataclasses.replace(BASE, epochs=2, batch_size=8, max_nonfinite_steps=2)
    set_seed(0)
    model = Normed()
    bad = colour_data(40)
    bad.tensors[0][:] = float("nan")
    val = loader(colour_data(12), config, False)
    with pytest.raises(DivergedError):
        train(model, loader(bad, config), val, config)
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())
    result = train(model, loader(colour_data(40), config), val, config)
    assert all(math.isfinite(row["val_loss"]) for row in result.history)
    assert result.best_val_acc > 0.5


def test_a_run_shorter_than_the_limit_whose_every_step_is_nan_is_no_result():
    """Three batches in all, each NaN, under a limit of 5 in a row: no update was applied,
    and the run must not end as if it trained (a tuner would score the untrained model)."""
    data = colour_data(8)
    data.tensors[0][:] = float("nan")
    with pytest.raises(DivergedError, match=r"NaN/inf in every optimizer step of this run "
                                            r"\(3 batches\), so no update was applied"):
        fit(dataclasses.replace(BASE, epochs=3, batch_size=8, max_nonfinite_steps=5), data)
    # one finite step is a run, however few
    some = colour_data(16)
    some.tensors[0][8:] = float("nan")
    config = dataclasses.replace(BASE, epochs=2, batch_size=8, max_nonfinite_steps=5)
    result = train(TinyNet(), DataLoader(some, batch_size=8), loader(colour_data(12), config,
                                                                      False), config)
    assert result.nonfinite_steps == 2 and result.epochs_run == 2


def test_an_update_that_leaves_nan_weights_is_a_divergence_however_few_the_batches():
    """One batch an epoch: the first update (finite loss) made the weights inf, every later
    loss was NaN, but never max_nonfinite_steps in a row, and the NaN model was kept as the
    run's best (a user's tiny set at --lr 10 saved it and reported 0% as a result)."""
    config = dataclasses.replace(BASE, epochs=3, batch_size=8, optimizer="sgd", lr=1e38,
                                 max_nonfinite_steps=5)
    with pytest.raises(DivergedError, match=r"after epoch 2 every training batch's loss was "
                                            r"NaN/inf, and the validation loss too "
                                            r"\(lr=1e\+38\); lower --lr"):
        train(TinyNet(), loader(colour_data(8), config), loader(colour_data(8), config, False),
              config)
    model = TinyNet()  # weights that are NaN themselves: said after the epoch that made them
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    config = dataclasses.replace(config, lr=1e-3, optimizer="adam")
    with pytest.raises(DivergedError, match=r"after epoch 1 its weights were NaN/inf"):
        train(model, loader(colour_data(8), config), loader(colour_data(8), config, False),
              config)


def test_a_resumed_sessions_nan_steps_are_not_a_run_without_an_update(tmp_path):
    """The earlier session applied its updates: a resumed last epoch whose few steps are all
    NaN ends as the uninterrupted run would, not as one that never trained."""
    config = dataclasses.replace(BASE, epochs=2, batch_size=8, max_nonfinite_steps=5)
    with pytest.raises(Interrupted):
        fit(config, colour_data(16), checkpoint_path=tmp_path / "c.pt",
            on_epoch=interrupt_after(1))
    bad = colour_data(16)
    bad.tensors[0][:] = float("nan")
    resumed = fit(config, bad, checkpoint_path=tmp_path / "c.pt", resume=True)
    assert resumed.resumed_from_epoch == 1 and resumed.nonfinite_steps == 2


@pytest.mark.parametrize("scheduler", ["cosine", "onecycle"])
def test_a_skipped_window_uses_up_its_step_of_the_schedule(scheduler, recwarn):
    """A window skipped for a NaN still steps the schedule (as fp16's GradScaler skips do): the
    last optimizer step is at the schedule's end, as in a run without the NaN."""
    config = dataclasses.replace(BASE, epochs=3, scheduler=scheduler, optimizer="adamw",
                                 lr=0.01, batch_size=8)
    data = colour_data(40)
    data.tensors[0][0] = float("nan")  # the first batch of every epoch, the first step included
    def run(data):
        set_seed(config.seed)
        return train(TinyNet(), DataLoader(data, batch_size=8),
                     loader(colour_data(12, seed=1), config, False), config)
    clean, skipped = run(colour_data(40)), run(data)
    assert skipped.nonfinite_steps == 3
    assert [r["lr"] for r in skipped.history][-1] == pytest.approx(clean.history[-1]["lr"])
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_with_accumulation_a_nan_in_every_window_stops_the_run():
    """A finite batch in a window skipped for another's NaN applies no update: it must not
    reset the count, or a run that never steps trains on, unchanged, to its end."""
    data = colour_data(32)
    data.tensors[0][torch.arange(32) % 16 == 0] = float("nan")
    config = dataclasses.replace(BASE, epochs=5, batch_size=8, grad_accum_steps=2,
                                 max_nonfinite_steps=5)
    set_seed(config.seed)
    plain = DataLoader(data, batch_size=8, shuffle=False)  # a NaN leads every window
    with pytest.raises(DivergedError, match=r"5 batches with no update .* up to epoch 3"):
        train(TinyNet(), plain, loader(colour_data(12, seed=1), config, False), config)


def test_a_resumed_run_diverges_where_the_uninterrupted_one_does(tmp_path):
    small = colour_data(16)
    small.tensors[0][:] = float("inf")  # two batches an epoch, every one bad
    config = dataclasses.replace(BASE, epochs=4, batch_size=8, max_nonfinite_steps=3)
    with pytest.raises(Interrupted):
        fit(config, small, checkpoint_path=tmp_path / "ck.pt", on_epoch=interrupt_after(1))
    with pytest.raises(DivergedError, match=r"up to epoch 2"):
        fit(config, small, checkpoint_path=tmp_path / "ck.pt", resume=True)


def test_a_skipped_batch_leaves_batchnorms_statistics_as_they_were():
    """BatchNorm (resnet18, mobilenet) updates its running statistics in the forward pass: a
    batch skipped for a NaN/inf must not leave them NaN, or every later evaluation is."""
    data = colour_data()
    data.tensors[0][5] = float("inf")  # one batch an epoch
    config = dataclasses.replace(BASE, epochs=2)
    set_seed(config.seed)
    result = train(Normed(), loader(data, config), loader(colour_data(24, seed=1), config, False),
                   config)
    assert result.nonfinite_steps == 2
    assert all(torch.isfinite(b.float()).all() for b in result.model.buffers())
    assert math.isfinite(result.history[-1]["val_loss"]) and result.best_val_acc > 0.6


@pytest.mark.parametrize("scheduler", ["cosine", "onecycle"])
def test_schedules_step_per_optimizer_step(scheduler):
    config = dataclasses.replace(BASE, epochs=2, scheduler=scheduler, optimizer="adamw", lr=0.01)
    lrs = [r["lr"] for r in fit(config).history]
    assert lrs[-1] < 0.02 * config.lr  # both anneal to ~0 by the last optimizer step
    if scheduler == "onecycle":
        assert lrs[0] > 0.001  # warmed up towards the peak during epoch 1


@pytest.mark.parametrize("scheduler", ["cosine", "none"])
def test_a_warm_up_ramps_the_rate_before_the_schedule(scheduler):
    """One epoch of 10 steps ramps the rate linearly to its peak, then cosine anneals it over
    the remaining steps (constant stays at the peak); onecycle keeps its own ramp."""
    config = dataclasses.replace(BASE, epochs=3, scheduler=scheduler, warmup_epochs=1.0, lr=0.1)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    scheduler_ = make_scheduler(optimizer, config, steps_per_epoch=10)
    lrs = []
    for _ in range(30):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler_.step()
    assert lrs[:10] == pytest.approx([0.1 * (i + 1) / 11 for i in range(10)])
    assert lrs[10] == pytest.approx(0.1)
    if scheduler == "cosine":
        assert lrs[15] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 5 / 20)))
        assert lrs[-1] < 0.002 and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    else:
        assert lrs[10:] == pytest.approx([0.1] * 20)
    # a one-epoch run ramps up over half of it and still anneals
    one = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    short = make_scheduler(one, dataclasses.replace(config, epochs=1), steps_per_epoch=10)
    lrs = []
    for _ in range(10):
        lrs.append(one.param_groups[0]["lr"])
        one.step()
        short.step()
    assert lrs[4] == pytest.approx(0.1 * 5 / 6) and lrs[5] == pytest.approx(0.1)
    assert lrs[-1] < (0.05 if scheduler == "cosine" else 0.11)
    plain = make_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                           dataclasses.replace(config, warmup_epochs=0.0), steps_per_epoch=10)
    assert plain.get_last_lr() == [0.1]
    onecycle = make_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                              dataclasses.replace(config, scheduler="onecycle"), 10)
    assert isinstance(onecycle, torch.optim.lr_scheduler.OneCycleLR)
    with pytest.raises(UserError, match="warmup_epochs"):
        dataclasses.replace(config, warmup_epochs=-1)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_onecycle_keeps_the_sgd_momentum_asked_for(momentum):
    """OneCycleLR cycles momentum between 0.85 and 0.95 by default: --momentum would be
    ignored while the settings recorded it."""
    config = dataclasses.replace(BASE, optimizer="sgd", momentum=momentum, scheduler="onecycle")
    optimizer = make_optimizer(TinyNet(), config, torch.device("cpu"))
    scheduler = make_scheduler(optimizer, config, steps_per_epoch=10)
    seen = set()
    for _ in range(config.epochs * 10 - 1):
        optimizer.step()
        scheduler.step()
        seen.add(optimizer.param_groups[0]["momentum"])
    assert seen == {momentum}


def test_a_checkpoint_from_before_the_warm_up_setting_resumes(tmp_path):
    config = dataclasses.replace(BASE, epochs=2)
    fit(config, checkpoint_path=tmp_path / "ckpt.pt")
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    del ckpt["config"]["warmup_epochs"]  # written by a version without it
    ckpt["finished"] = False
    torch.save(ckpt, tmp_path / "ckpt.pt")
    assert fit(config, checkpoint_path=tmp_path / "ckpt.pt", resume=True).resumed_from_epoch == 2
    with pytest.raises(UserError, match=r"warmup_epochs 0.0 -> 1"):
        fit(dataclasses.replace(config, warmup_epochs=1), checkpoint_path=tmp_path / "ckpt.pt",
            resume=True)


def test_a_checkpoint_whose_contents_are_damaged_is_one_line_naming_the_remedy(tmp_path):
    """A file torch reads, of this format, but not what save() wrote: a missing key, weights
    of other shapes, an optimizer of other groups. Each was a traceback."""
    config = dataclasses.replace(BASE, epochs=2)
    with pytest.raises(Interrupted):
        fit(config, checkpoint_path=tmp_path / "ckpt.pt", on_epoch=interrupt_after(1))
    good = load_checkpoint(tmp_path / "ckpt.pt")
    weights = {k: v[:1] if v.dim() else v for k, v in good["model"].items()}
    damaged = [{k: v for k, v in good.items() if k != "history"},
               {**good, "model": weights},
               {**good, "optimizer": {**good["optimizer"], "param_groups": []}},
               {**good, "rng": {"torch": torch.zeros(3, dtype=torch.uint8)}}]
    for i, ckpt in enumerate(damaged):
        torch.save(ckpt, tmp_path / f"d{i}.pt")
        with pytest.raises(UserError, match="is damaged .*; delete it to start this scenario "
                                            "over") as err:
            fit(config, checkpoint_path=tmp_path / f"d{i}.pt", resume=True)
        assert "\n" not in str(err.value)
    (tmp_path / "torn.pt").write_bytes((tmp_path / "ckpt.pt").read_bytes()[:100])
    with pytest.raises(UserError, match=r"is cut short \(an incomplete copy or download\?\); "
                                        r"delete it"):
        fit(config, checkpoint_path=tmp_path / "torn.pt", resume=True)


def test_resume_continues_and_matches_an_uninterrupted_run(tmp_path):
    config = dataclasses.replace(BASE, epochs=4, optimizer="adam", lr=0.01, scheduler="cosine")
    full = fit(config, checkpoint_path=tmp_path / "full.pt")
    with pytest.raises(Interrupted):
        fit(config, checkpoint_path=tmp_path / "part.pt", on_epoch=interrupt_after(2))
    assert load_checkpoint(tmp_path / "part.pt")["epoch"] == 2

    # the same state, as if its first epochs had been timed on another device
    other = load_checkpoint(tmp_path / "part.pt")
    other["timing"]["device"] = "cuda"
    torch.save(other, tmp_path / "other.pt")
    resumed = fit(config, checkpoint_path=tmp_path / "part.pt", resume=True)
    assert resumed.resumed_from_epoch == 2 and resumed.epochs_run == 4
    assert [r["val_acc"] for r in resumed.history] == [r["val_acc"] for r in full.history]
    assert [r["train_loss"] for r in resumed.history] == [r["train_loss"] for r in full.history]
    for pa, pb in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    # the step timing and the wall time cover the epochs of both processes (each process
    # leaves its own warm-up steps out)
    batches_left = 2 * resumed.settings["steps_per_epoch"]
    second_warmup = TIMING_WARMUP_STEPS if batches_left > 2 * TIMING_WARMUP_STEPS else 0
    assert resumed.timing["steps"] == full.timing["steps"] - second_warmup
    assert resumed.timing["samples"] > batches_left * BASE.batch_size
    assert resumed.wall_s > resumed.history[1]["elapsed_s"]
    elsewhere = fit(config, checkpoint_path=tmp_path / "other.pt", resume=True)
    assert elsewhere.timing["steps"] == batches_left - second_warmup  # not mixed with another device's


def test_resume_refuses_changed_settings(tmp_path):
    fit(dataclasses.replace(BASE, epochs=1), checkpoint_path=tmp_path / "c.pt")
    with pytest.raises(UserError, match="settings changed.*batch_size.*resume with the options"):
        fit(dataclasses.replace(BASE, epochs=1, batch_size=4), checkpoint_path=tmp_path / "c.pt",
            resume=True)


def test_a_checkpoint_resumes_on_a_machine_unlike_the_one_that_saved_it(tmp_path, monkeypatch):
    """Saved where fp16 was off (its GradScaler state is empty) and the GPUs were eight, it
    resumes where fp16 is on (a T4) and there is one GPU: a fresh scale, the GPUs there are."""
    from modules import checkpoints
    fit(dataclasses.replace(BASE, epochs=1), checkpoint_path=tmp_path / "c.pt")
    ckpt = load_checkpoint(tmp_path / "c.pt")
    assert ckpt["scaler"] == {}
    ckpt["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8) + i for i in range(8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: restored.append((int(state[0]), device)))
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.save(ckpt, tmp_path / "c.pt")
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # fp16's, as on a GPU
    progress = checkpoints.CheckpointSaver(tmp_path / "c.pt", dataclasses.replace(
        BASE, epochs=1)).restore(model, optimizer, scheduler, scaler)
    assert progress.resumed_from == 1 and scaler.is_enabled() and restored == [(0, 0)]


def test_on_epoch_sees_every_epoch_and_can_stop_training():
    seen = []
    fit(dataclasses.replace(BASE, epochs=3), on_epoch=lambda e, m: seen.append((e, m["val_acc"])))
    assert [e for e, _ in seen] == [1, 2, 3] and all(0 <= a <= 1 for _, a in seen)


def test_tensorboard_scalars_and_config_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    fit(dataclasses.replace(BASE, epochs=2), run_dir=tmp_path / "run")
    events = EventAccumulator(str(tmp_path / "run"))  # the file alone is made on opening
    events.Reload()
    assert {"train/loss", "val/acc"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("val/acc")] == [1, 2]
    assert '"batch_size": 8' in (tmp_path / "run" / "config.json").read_text()


def test_an_epoch_logged_before_its_checkpoint_was_cut_shows_once_after_resume(tmp_path,
                                                                              monkeypatch):
    """Stopped while epoch 2's checkpoint was written (its scalars already flushed), the resumed
    run trained epoch 2 again: TensorBoard showed it twice, two throughputs at one step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from modules import checkpoints
    saved = []
    real = checkpoints.save_checkpoint

    def cut_at_the_second(path, state):
        saved.append(path)
        if len(saved) == 2:
            raise KeyboardInterrupt
        real(path, state)
    monkeypatch.setattr(checkpoints, "save_checkpoint", cut_at_the_second)
    config = dataclasses.replace(BASE, epochs=3)
    kwargs = {"run_dir": tmp_path / "run", "checkpoint_path": tmp_path / "c.pt"}
    with pytest.raises(KeyboardInterrupt):
        fit(config, **kwargs)
    monkeypatch.setattr(checkpoints, "save_checkpoint", real)
    assert fit(config, resume=True, **kwargs).resumed_from_epoch == 1
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    for tag in ("train/loss", "val/acc", "samples/per_s"):
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3], tag


def test_a_finished_run_resumed_purges_no_scalars(tmp_path):
    """Resumed after it finished, a run trains nothing and must drop nothing: its folder may
    hold the scalars of another scenario's final run it took, with more epochs (the hpo row
    taking the resolution's). Nor does it add an empty event file, as each --resume did."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    config = dataclasses.replace(BASE, epochs=2)
    kwargs = {"run_dir": tmp_path / "run", "checkpoint_path": tmp_path / "c.pt"}
    fit(config, **kwargs)
    with SummaryWriter(str(tmp_path / "run")) as taken:  # a longer run's epochs 3 and 4
        for step in (3, 4):
            taken.add_scalar("train/loss", 1.0, step)
    files = sorted((tmp_path / "run").glob("events.out.tfevents.*"))
    for _ in range(2):
        assert fit(config, resume=True, **kwargs).resumed_from_epoch == 2
    assert sorted((tmp_path / "run").glob("events.out.tfevents.*")) == files
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_tensorboards_writer_thread_prints_no_traceback_for_a_full_disk(tmp_path, monkeypatch):
    """TensorBoard writes its event file from a thread of its own; a full disk there printed
    that thread's traceback before the run ended with its one line (the error is raised again
    in the training loop, which says it)."""
    import errno
    import threading
    from tensorboard.summary.writer import record_writer
    calls = []

    def full(self, data):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    printed = []
    hook = printed.append  # what threading would print, as its default hook does
    monkeypatch.setattr(threading, "excepthook", hook)
    with pytest.raises(OSError) as ended:
        fit(dataclasses.replace(BASE, epochs=3), run_dir=tmp_path / "run")
    assert calls and ended.value.errno == errno.ENOSPC
    assert printed == [] and threading.excepthook is hook  # as it was, once the run ended


def test_a_writer_that_missed_its_wake_up_still_closes_at_once(tmp_path):
    """A Ctrl-C inside TensorBoard's queue code can cost its writer thread the wake-up for
    close()'s stop signal: close() then waited out the thread's flush interval, 120 s by
    default, before the run said it was interrupted."""
    import threading
    from modules.trainer import _summary_writer
    writer = _summary_writer(tmp_path / "run", BASE)
    writer.add_scalar("train/loss", 1.0, 1)
    writer.flush()
    queue = writer.file_writer.event_writer._async_writer._byte_queue
    queue.not_empty.notify = lambda n=1: None  # the lost wake-up
    closer = threading.Thread(target=writer.close, daemon=True)
    started = time.perf_counter()
    closer.start()
    closer.join(timeout=20)
    assert not closer.is_alive() and time.perf_counter() - started < 10


def test_a_stopped_run_closes_its_tensorboard_file(tmp_path, monkeypatch):
    """A pruned trial (on_epoch raises) leaves no writer thread or open event file behind in
    the notebook's kernel."""
    from torch.utils.tensorboard import SummaryWriter
    closed = []
    original = SummaryWriter.close
    monkeypatch.setattr(SummaryWriter, "close", lambda w: closed.append(w) or original(w))

    def stop(epoch, metrics):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(dataclasses.replace(BASE, epochs=2), run_dir=tmp_path / "run", on_epoch=stop)
    assert len(closed) == 1


def test_channels_last_trains_to_the_same_result():
    a = fit(dataclasses.replace(BASE, epochs=1))
    b = fit(dataclasses.replace(BASE, epochs=1, channels_last=True))
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5)
    # and the layout was used: two identical runs would also pass the comparison above
    assert b.model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not a.model.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_autocast_policy():
    cpu = torch.device("cpu")
    assert autocast_dtype("off", cpu) is None
    assert autocast_dtype("auto", cpu) is None  # no native bf16 assumed on CPU
    assert autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(UserError, match="fp16 needs a CUDA GPU"):
        autocast_dtype("fp16", cpu)


def test_bf16_autocast_trains_on_cpu(monkeypatch):
    seen = []
    forward = TinyNet.forward

    def spied(self, x):
        out = forward(self, x)
        seen.append((self.training, out.dtype))
        return out
    monkeypatch.setattr(TinyNet, "forward", spied)
    result = fit(dataclasses.replace(BASE, epochs=2, amp="bf16"))
    assert result.settings["amp_dtype"] == "bfloat16" and result.best_val_acc > 0.6
    # the training steps ran under bf16 autocast (fp32 reaches the same accuracy)
    assert {dtype for training, dtype in seen if training} == {torch.bfloat16}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_with_grad_scaler_on_gpu():
    result = fit(dataclasses.replace(BASE, epochs=2, amp="fp16", device="cuda"))
    assert result.settings["amp_dtype"] == "float16" and result.best_val_acc > 0.6


def test_a_compile_a_full_tmpdir_stopped_says_where_it_writes(monkeypatch, tmp_path):
    """A 64 KB TMPDIR: "torch.compile failed here (OSError: [Errno 28] No space left on
    device)" sent the user to look at the output disk, where nothing was short."""
    from modules.files import compile_failure
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    said = compile_failure("OSError: [Errno 28] No space left on device")
    assert said.endswith(f"it writes its kernels under {tmp_path} (TORCHINDUCTOR_CACHE_DIR "
                         "or TMPDIR)")
    assert compile_failure("InvalidCxxCompiler: none") == "InvalidCxxCompiler: none"


def test_a_compile_that_cannot_build_trains_eager_and_says_so(monkeypatch, caplog):
    """--compile on a machine without a C++ compiler: inductor fails at the first pass."""
    import torch._dynamo.exc as dynamo_exc

    class NoCompiler(dynamo_exc.BackendCompilerFailed):
        def __init__(self):
            RuntimeError.__init__(self, "InvalidCxxCompiler: No working C++ compiler found")

    def broken(*_):
        raise NoCompiler()
    monkeypatch.setattr(torch, "compile", lambda model, **_: broken)
    with caplog.at_level("WARNING"):
        result = fit(dataclasses.replace(BASE, compile=True))
    eager = fit(BASE)
    assert result.settings["compile_failed"].startswith("InvalidCxxCompiler")
    assert "torch.compile failed here" in caplog.text
    assert [r["train_loss"] for r in result.history] == \
        pytest.approx([r["train_loss"] for r in eager.history])  # nothing of the failed pass


def test_a_run_ended_within_the_timing_warm_up_reports_its_steps_not_zero():
    """Early stopping can end a run before any step past the timing warm-up: its figures are
    then the warm-up steps' own, and with no step at all None (not measured), never 0."""
    from modules.trainer import StepTimer
    timer = StepTimer(torch.device("cpu"), planned_steps=100)
    assert timer.warmup > 2
    assert timer.summary()["avg_step_ms"] is None and timer.summary()["samples_per_s"] is None
    for _ in range(2):
        timer.begin(), timer.loaded(), timer.copied()
        time.sleep(0.01)
        timer.end(samples=8)
    figures = timer.summary()
    assert figures["avg_step_ms"] >= 10 and figures["samples_per_s"] > 0
    assert figures["cpu_exec_us"] >= 0 and figures["warmup_steps"] == 0 and figures["steps"] == 2


class _SlowProfiler:
    """A profiler whose steps 4-6 are recorded (each 0.2 s slower) and whose step after them
    writes its trace for 0.5 s."""

    def __init__(self):
        self.steps = 0

    @property
    def recording(self):
        return 3 <= self.steps < 6

    def step(self):
        self.steps += 1
        if self.steps == 6:
            time.sleep(0.5)


def test_the_profilers_own_time_is_not_the_runs(monkeypatch):
    """--profile's trace writing is not training time (wall_s, epoch_s, elapsed_s, the
    epoch's samples/s), and its slower recorded steps are left out of the step timing."""
    import modules.trainer as trainer_module
    real_forward_backward = trainer_module._Epochs._forward_backward

    def slower_when_profiled(self, *a, **k):
        if getattr(self.profiler, "recording", False):
            time.sleep(0.2)
        return real_forward_backward(self, *a, **k)
    monkeypatch.setattr(trainer_module._Epochs, "_forward_backward", slower_when_profiled)
    config = dataclasses.replace(BASE, epochs=2)
    started = time.perf_counter()
    result = fit(config, colour_data(96), profiler=_SlowProfiler())  # 12 steps per epoch
    took = time.perf_counter() - started
    assert result.wall_s < took - 0.45
    assert sum(r["epoch_s"] for r in result.history) < took - 0.45
    assert result.history[-1]["elapsed_s"] < took - 0.45
    assert result.timing["steps"] == 24 - TIMING_WARMUP_STEPS - 3  # the recorded three left out
    assert result.timing["avg_step_ms"] < 100


def test_a_resume_with_other_steps_per_epoch_or_momentum_is_refused(tmp_path):
    """The schedule is laid out in steps per epoch (a torchrun run resumed in one process has
    twice as many): resumed with others it would anneal to zero mid-run and rise again. A
    changed momentum would be silently the checkpoint's (its optimizer state holds it)."""
    config = dataclasses.replace(BASE, epochs=2, scheduler="cosine")
    path = tmp_path / "c.pt"

    def stop(epoch, metrics):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        fit(config, colour_data(24), checkpoint_path=path, on_epoch=stop)
    with pytest.raises(UserError, match="its epochs had 3 steps, this run's have 6"):
        fit(config, colour_data(48), checkpoint_path=path, resume=True)
    with pytest.raises(UserError, match="momentum 0.9 -> 0.0"):
        fit(dataclasses.replace(config, momentum=0.0), colour_data(24), checkpoint_path=path,
            resume=True)
    assert fit(config, colour_data(24), checkpoint_path=path, resume=True).resumed_from_epoch == 1


def test_patience_running_out_at_the_last_epoch_is_not_an_early_stop(tmp_path):
    """The run trained every epoch, yet said it stopped early; resumed after it had finished,
    the same run said it had not."""
    cfg = dataclasses.replace(BASE, epochs=3, early_stopping_patience=2)
    val = colour_data(24, seed=1, shift=1)  # labels shifted: no epoch after the first is better
    result = fit(cfg, val_data=val, checkpoint_path=tmp_path / "c.pt")
    assert result.best_epoch == 1 and result.epochs_run == 3 and not result.stopped_early
    again = fit(cfg, val_data=val, checkpoint_path=tmp_path / "c.pt", resume=True)
    assert again.epochs_run == 3 and not again.stopped_early


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_onecycle_on_a_run_of_few_steps_trains_at_the_learning_rate(steps):
    """Its first step takes lr / 25 and its last lr / 250,000: a run of one or two steps
    barely moved. Cosine instead starts at lr."""
    cfg = dataclasses.replace(BASE, scheduler="onecycle", epochs=1, lr=1e-3)
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    scheduler = make_scheduler(opt, cfg, steps)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    for _ in range(steps):
        opt.step()
        scheduler.step()
    many = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    make_scheduler(many, cfg, 100)
    assert many.param_groups[0]["lr"] == pytest.approx(1e-3 / 25)  # one-cycle from 4 steps on


def test_a_onecycle_too_short_records_the_cosine_it_ran():
    """The log said "cosine instead"; the row's settings said onecycle."""
    config = dataclasses.replace(BASE, scheduler="onecycle", epochs=1)
    result = train(TinyNet(), loader(colour_data(16), config), loader(colour_data(8), config,
                                                                       False), config)
    assert result.settings["scheduler_run"] == "cosine"
    longer = dataclasses.replace(config, epochs=2)
    assert train(TinyNet(), loader(colour_data(16), longer), loader(colour_data(8), longer,
                                                                    False), longer
                 ).settings["scheduler_run"] == "onecycle"


def test_a_window_with_a_short_batch_updates_as_one_large_batch_of_its_samples():
    """Each batch's mean loss was divided by the window's batch count: with batches 8, 8, 8
    and 2, each of the last two samples weighed four times what one batch of 26 gives it."""
    data = colour_data(26)

    def trained(batch_size, accum):
        cfg = dataclasses.replace(BASE, epochs=1, batch_size=batch_size, grad_accum_steps=accum)
        set_seed(0)
        keeps_last = DataLoader(data, batch_size=batch_size, shuffle=False)  # 8, 8, 8, 2
        return train(TinyNet(), keeps_last, loader(colour_data(12, seed=1), cfg, False),
                     cfg).model
    one, four = trained(26, 1), trained(8, 4)
    for a, b in zip(one.parameters(), four.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_last_short_window_of_an_epoch_is_stepped_within_it():
    """Six batches with grad_accum_steps 4: the last two make a window of their own, stepped
    before the epoch ends (two steps an epoch, as the schedule counts them), as one batch of
    their 16 samples would be; else they drift into the next epoch's first window."""
    data = colour_data(48)
    steps = []

    def trained(batch_size, accum, epochs):
        cfg = dataclasses.replace(BASE, epochs=epochs, batch_size=batch_size,
                                  grad_accum_steps=accum)
        set_seed(0)
        in_order = DataLoader(data, batch_size=batch_size, shuffle=False)
        return train(TinyNet(), in_order, loader(colour_data(12, seed=1), cfg, False), cfg)
    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: steps.append(1))
    try:
        accumulated = trained(8, 4, epochs=2)
    finally:
        handle.remove()
    assert len(steps) == 2 * math.ceil(6 / 4) and accumulated.settings["steps_per_epoch"] == 2
    one, four = trained(32, 1, epochs=1).model, trained(8, 4, epochs=1).model
    for a, b in zip(one.parameters(), four.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bf16_on_a_gpu_without_bf16_units_warns_once(monkeypatch, caplog):
    """A T4 (compute capability 7.5) runs bf16 emulated; --amp bf16 there, or a run resumed
    on it with bf16 saved from an A100, says so once."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    cuda = torch.device("cuda")
    with caplog.at_level("WARNING", logger="modules.device"):
        assert autocast_dtype("bf16", cuda) is torch.bfloat16
        assert autocast_dtype("bf16", cuda) is torch.bfloat16
        assert autocast_dtype("auto", cuda) is torch.float16
    assert caplog.text.count("--amp bf16 on Tesla T4") == 1
    assert "emulated" in caplog.text
