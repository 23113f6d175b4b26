"""ResolutionTuner: one short run per size (the default's always among them), the pick, ties
within one standard error to the default or the cheaper size, the trade-off, and the stop of a
size clearly behind at half its compute."""
from types import SimpleNamespace

import pytest
import torch

from conftest import make_folder
from modules.config import TrainConfig, UserError
from modules.dataset import index_dataset
from modules.models import build_model
from resolution_tuner import ResolutionTrial, ResolutionTuner

BASE = TrainConfig(model="resnet18", weights="none", image_size=24, epochs=2, batch_size=8,
                   device="cpu", progress=False, seed=0)


def trial(size, acc, epoch_s=1.0):
    return ResolutionTrial(image_size=size, val_acc=acc, samples_per_s=100.0, epoch_s=epoch_s,
                           wall_s=2 * epoch_s)


def test_pick_takes_the_most_accurate_size_when_it_is_clear_of_the_noise():
    # 1,000 validation images: one standard error of a difference is about 2 points
    assert ResolutionTuner.pick([trial(32, 0.5), trial(48, 0.8), trial(64, 0.7)], 1000) == 48
    assert ResolutionTuner.pick([trial(32, 0.5), trial(48, 0.8), trial(64, 0.7)], 1000, 64) == 48


def test_a_tie_within_one_standard_error_keeps_the_default_else_the_cheaper_size():
    trials = [trial(64, 0.78), trial(48, 0.77), trial(96, 0.80)]
    # 300 images: SE of the difference ~3.3 points, so all three tie
    assert ResolutionTuner.pick(trials, 300, default_size=64) == 64
    assert ResolutionTuner.pick(trials, 300, default_size=None) == 48
    # 100,000 images: a 2-point gap is far outside the noise; the best wins
    assert ResolutionTuner.pick(trials, 100_000, default_size=64) == 96
    # equal scores always tie, even on a huge set
    assert ResolutionTuner.pick([trial(64, 0.8), trial(96, 0.8)], 10**9, default_size=64) == 64


def test_a_size_level_with_the_default_does_not_replace_it_through_a_leader():
    """48 px ties with 96 px, which beats the default, but 48 px is itself level with the
    default: "the smallest of the tied" replaced the default with a size no better than it."""
    trials = [trial(48, 0.53), trial(64, 0.50), trial(96, 0.56)]  # SE of a difference ~3.7
    assert ResolutionTuner.pick(trials, 360, default_size=64) == 96
    trials = [trial(48, 0.55), trial(64, 0.50), trial(96, 0.56)]  # 48 px beats the default too
    assert ResolutionTuner.pick(trials, 360, default_size=64) == 48


def test_the_default_size_is_always_a_candidate(tmp_path):
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    tuner = ResolutionTuner(index, BASE, [32, 40])
    assert tuner.resolutions == [24, 32, 40] and tuner.default_size == 24


def test_runs_every_candidate_and_reports_the_tradeoff(tmp_path):
    index = index_dataset(make_folder(tmp_path / "d", n_train=10, n_test=3))
    tuner = ResolutionTuner(index, BASE, [32, 24])
    best = tuner.run()
    assert [t.image_size for t in tuner.trials] == [24, 32] and best in (24, 32)
    assert all(0 <= t.val_acc <= 1 and t.samples_per_s > 0 and t.epoch_s > 0 for t in tuner.trials)
    assert tuner.n_val == len(index.val)
    assert not any(tuner.trial_config(s).cudnn_benchmark for s in (24, 32))  # as_trial
    rows = tuner.tradeoff()
    assert rows[0]["points_per_extra_epoch_s"] is None and "val_acc" in rows[1]
    assert tuner.save_plot(tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_each_sizes_trial_keeps_its_weights_for_the_final_run(tmp_path):
    index = index_dataset(make_folder(tmp_path / "d", n_train=10, n_test=3))
    tuner = ResolutionTuner(index, BASE, [32], weights_dir=tmp_path / "w")
    tuner.run()
    for size in (24, 32):
        path, epochs = tuner.weights_for(size)
        assert path.name.startswith(f"resolution-{size}px-") and epochs == tuner.epochs_for(size)
        kept = torch.load(path, weights_only=True)["state_dict"]
        model = build_model(BASE.model, len(index.classes), str(path))  # whole, head included
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(tensor, kept[name])
    assert ResolutionTuner(index, BASE, [32]).weights_for(24) == (None, 0)  # none kept
    # a run of the version that named them by size alone, resumed: its weights are found
    for path in (tmp_path / "w").glob("resolution-24px-*"):
        path.rename(tmp_path / "w" / "resolution-24px.weights.pt")
    assert tuner.weights_for(24)[0].name == "resolution-24px.weights.pt"


def test_a_resume_back_on_earlier_settings_finds_their_weights_not_a_later_sessions(
        tmp_path, monkeypatch):
    """The journal keeps each settings' results, but the weights were named by size alone: a
    session with another --lr overwrote them, and a third back on the first settings reused
    their journaled trials with the second's weights, which the final run then continued."""
    import dataclasses

    import resolution_tuner
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    real_fit = resolution_tuner.fit

    def fit(idx, cfg, **kw):  # each model's first weight marks the lr it trained with
        result = real_fit(idx, cfg, **kw)
        with torch.no_grad():
            next(result.model.parameters()).view(-1)[0] = cfg.lr
        return result
    monkeypatch.setattr(resolution_tuner, "fit", fit)
    journal, weights = tmp_path / "resolution.tuning.json", tmp_path / "w"
    for lr, trains in ((1e-3, True), (5e-2, True), (1e-3, False)):
        tuner = ResolutionTuner(index, dataclasses.replace(BASE, lr=lr), [32], journal=journal,
                                resume=True, weights_dir=weights)
        tuner.run()
        assert (tuner.reused == []) == trains
        for size in (24, 32):
            kept = torch.load(tuner.weights_for(size)[0], weights_only=True)["state_dict"]
            assert next(iter(kept.values())).view(-1)[0].item() == pytest.approx(lr)


def test_a_journal_or_weights_that_cannot_be_written_do_not_stop_the_tuning(tmp_path,
                                                                             monkeypatch, caplog):
    """Only rank 0 writes them: raised there, the other ranks of a torchrun went on into the
    next trial's collectives and ended with a gloo traceback. Each serves a resume or a warm
    start only; the tuning goes on without it, and says so."""
    import errno
    import logging

    import resolution_tuner

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(resolution_tuner, "atomic_write_text", full)
    monkeypatch.setattr(resolution_tuner, "save_weights", full)
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    tuner = ResolutionTuner(index, BASE, [32], journal=tmp_path / "j.json",
                            weights_dir=tmp_path / "w")
    with caplog.at_level(logging.WARNING):
        assert tuner.run() in (24, 32)
    assert tuner.weights_for(24) == (None, 0)
    assert "could not write" in caplog.text and "could not keep the trial's weights" in caplog.text


def test_sizes_below_the_models_minimum_are_refused(tmp_path):
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    with pytest.raises(UserError, match="image_size"):
        ResolutionTuner(index, TrainConfig(model="squeezenet1_1"), [16, 64])


def test_a_resumed_tuning_trains_only_the_sizes_its_journal_does_not_hold(tmp_path, monkeypatch):
    import json

    import resolution_tuner
    index = index_dataset(make_folder(tmp_path / "d", n_train=10, n_test=3))
    journal = tmp_path / "checkpoints" / "resolution.tuning.json"
    first = ResolutionTuner(index, BASE, [24, 32], journal=journal)
    first.run()
    saved = json.loads(journal.read_text())
    assert [e["trial"]["image_size"] for e in saved["trials"]] == [24, 32]

    # interrupted after 24 px: the journal holds that size only
    saved["trials"] = saved["trials"][:1]
    journal.write_text(json.dumps(saved))
    trained = []
    real_fit = resolution_tuner.fit
    monkeypatch.setattr(resolution_tuner, "fit",
                        lambda idx, cfg, **kw: trained.append(cfg.image_size) or
                        real_fit(idx, cfg, **kw))
    resumed = ResolutionTuner(index, BASE, [24, 32], journal=journal, resume=True)
    resumed.run()
    assert trained == [32] and resumed.reused == [24]
    assert resumed.trials[0] == first.trials[0]  # the journaled result, as it was
    assert len(json.loads(journal.read_text())["trials"]) == 2

    # written by a version without a setting this one has (at its default): still reused
    trained.clear()
    saved = json.loads(journal.read_text())
    for entry in saved["trials"]:
        entry["config"] = json.dumps({k: v for k, v in json.loads(entry["config"]).items()
                                      if k != "warmup_epochs"}, sort_keys=True)
    journal.write_text(json.dumps(saved))
    ResolutionTuner(index, BASE, [24, 32], journal=journal, resume=True).run()
    assert trained == []

    # progress bars change nothing measured: still reused
    trained.clear()
    quiet = BASE.__class__(**{**BASE.to_dict(), "progress": not BASE.progress})
    ResolutionTuner(index, quiet, [24, 32], journal=journal, resume=True).run()
    assert trained == []

    # nor do speed knobs measured otherwise (a resume on Colab's next VM): every size was
    # trained again, and a noisy pick that differed then made the final run's checkpoint
    # refuse to resume
    faster = BASE.__class__(**{**BASE.to_dict(), "channels_last": not BASE.channels_last,
                               "cpu_threads": 1})
    ResolutionTuner(index, faster, [24, 32], journal=journal, resume=True).run()
    assert trained == []

    # a session that tries fewer sizes keeps the others' results for a later resume
    ResolutionTuner(index, BASE, [BASE.image_size], journal=journal, resume=True).run()
    assert len(json.loads(journal.read_text())["trials"]) == 2
    ResolutionTuner(index, BASE, [24, 32], journal=journal, resume=True).run()
    assert trained == []

    # without --resume, or with other settings, every size is trained again
    trained.clear()
    ResolutionTuner(index, BASE, [24, 32], journal=journal).run()
    assert trained == [24, 32]
    trained.clear()
    ResolutionTuner(index, BASE.__class__(**{**BASE.to_dict(), "lr": 0.5}), [24, 32],
                    journal=journal, resume=True).run()
    assert trained == [24, 32]

    # other data, or a journal it cannot read: trained again, said in the log, no error
    trained.clear()
    other = index_dataset(make_folder(tmp_path / "e", n_train=11, n_test=3))
    ResolutionTuner(other, BASE, [24], journal=journal, resume=True).run()
    assert trained == [24]
    journal.write_text("{not json")
    trained.clear()
    ResolutionTuner(index, BASE, [24], journal=journal, resume=True).run()
    assert trained == [24]


def test_every_size_gets_about_the_same_compute(tmp_path):
    """A size where one epoch costs over twice the compared compute is left out: its trial,
    at least one epoch, would lead on compute (256 px: 4x what 4 epochs at 64 px cost)."""
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    at_64 = BASE.__class__(**{**BASE.to_dict(), "image_size": 64})
    tuner = ResolutionTuner(index, at_64, [48, 96, 128, 256], epochs=4)
    assert tuner.resolutions == [48, 64, 96, 128]
    assert [tuner.epochs_for(s) for s in tuner.resolutions] == [7, 4, 2, 1]
    assert tuner.left_out == [256]  # run() says so
    assert ResolutionTuner(index, at_64, [256], epochs=16).resolutions == [64, 256]


def test_a_default_trial_at_chance_stays_only_while_no_size_has_left_chance():
    """Six classes, 360 images: chance is 16.7%, two standard errors 3.9 points. While every
    size is at chance the trials rank nothing and the default stays; a size that left chance at
    the same compute is ahead of a default still at chance (at the non-quick CPU sizes the
    default's 3 epochs often end there: docs/tuning.md)."""
    all_at_chance = [trial(48, 0.205), trial(64, 0.15), trial(96, 0.18)]
    assert ResolutionTuner.pick(all_at_chance, 360, 64, chance=1 / 6) == 64
    assert ResolutionTuner.pick(all_at_chance, 360, 64) == 48  # unchecked, 48 would win
    left = [trial(48, 0.33), trial(64, 0.19), trial(96, 0.18)]
    assert ResolutionTuner.pick(left, 360, 64, chance=1 / 6) == 48
    learning = [trial(48, 0.45), trial(64, 0.30), trial(96, 0.28)]
    assert ResolutionTuner.pick(learning, 360, 64, chance=1 / 6) == 48
    # 96 px left chance ahead of the default; 48 px ties with 96 by noise but is itself still
    # at chance (10 classes, 600 images: chance 10%, two standard errors 2.4 points)
    one_left = [trial(48, 0.115), trial(64, 0.09), trial(96, 0.13)]
    assert ResolutionTuner.pick(one_left, 600, 64, chance=0.1) == 96
    # one lucky epoch is not leaving chance: 48 px's best, epoch 1 of 4, was 2.3 standard
    # errors above it, and back at chance after (a reviewer's run picked it); a curve that left
    # and stayed out is ahead
    import dataclasses
    blip = [dataclasses.replace(trial(48, 0.219), val_curve=[0.219, 0.167, 0.175, 0.167]),
            dataclasses.replace(trial(64, 0.17), val_curve=[0.167, 0.17])]
    assert ResolutionTuner.pick(blip, 240, 64, chance=1 / 6) == 64
    blip[0] = dataclasses.replace(blip[0], val_acc=0.23, val_curve=[0.20, 0.219, 0.23, 0.225])
    assert ResolutionTuner.pick(blip, 240, 64, chance=1 / 6) == 48


def test_on_imbalanced_data_chance_is_the_largest_class_share():
    """400/20/20/20 images: a model answering the first class validates at 87% (80 of 92); a
    size there has not left chance, and the tuner judges by that share, not by 1/4."""
    val = [(None, 0)] * 80 + [(None, c) for c in (1, 2, 3) for _ in range(4)]
    index = SimpleNamespace(val=val, classes=["a", "b", "c", "d"])
    tuner = ResolutionTuner(index, TrainConfig(model="resnet18", image_size=64), [48])
    assert tuner.chance == pytest.approx(80 / 92)
    plateau = [trial(48, 80 / 92), trial(64, 72 / 92)]
    assert ResolutionTuner.pick(plateau, 92, 64, chance=tuner.chance) == 64
    assert ResolutionTuner.pick(plateau, 92, 64, chance=0.25) == 48  # as it was judged


def replay(curves, calls):
    """A stand-in for fit that reports the given validation curve of each size, epoch by epoch,
    through the trial's hook, as training would."""
    def fit(index, config, on_epoch=None):
        calls.append(config.image_size)
        curve = curves[config.image_size][:config.epochs]
        for epoch, acc in enumerate(curve, start=1):
            on_epoch(epoch, {"val_acc": acc, "epoch_s": 1.0, "samples_per_s": 100.0})
        return SimpleNamespace(timing={"samples_per_s": 100.0}, wall_s=float(len(curve)),
                               model=None, best_val_acc=max(curve))
    return fit


def test_a_size_clearly_behind_at_half_its_compute_is_stopped_there(tmp_path, monkeypatch):
    """Three classes on 360 images: chance is 33%, one standard error of a difference about
    3.6 points. The default size trains first. 48 px (7 epochs) is judged after 4, 2.25 epochs'
    compute at 64 px: ahead of 64 px's best within 2 epochs, it goes on. 96 px (2 epochs) is
    judged after 1, the same compute: level with 64 px there, it trails 48 px's best within 4
    epochs by 13 points and is stopped."""
    import resolution_tuner
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    base = BASE.__class__(**{**BASE.to_dict(), "image_size": 64})
    curves = {64: [0.33, 0.60, 0.70, 0.75],
              48: [0.33, 0.50, 0.60, 0.75, 0.76, 0.77, 0.78],
              96: [0.62, 0.80]}
    calls = []
    monkeypatch.setattr(resolution_tuner, "fit", replay(curves, calls))
    journal = tmp_path / "resolution.tuning.json"
    tuner = ResolutionTuner(index, base, [48, 96], epochs=4, journal=journal)
    tuner.n_val = 360
    assert tuner.run() == 64  # 48 px and 64 px tie; the stopped 96 px is not a candidate
    assert calls == [64, 48, 96]
    assert [t.image_size for t in tuner.trials] == [48, 64, 96]
    stopped = tuner.trials[2]
    assert stopped.stopped_after == 1 and stopped.val_curve == [0.62]
    assert [tuner.rung(s) for s in (48, 64, 96)] == [4, 2, 1]
    assert [t.stopped_after for t in tuner.trials[:2]] == [None, None]
    assert ResolutionTuner.pick(tuner.trials[2:] + [trial(64, 0.3)], 360, 64) == 64
    rows = tuner.tradeoff()
    assert rows[2]["stopped_after"] == 1 and rows[2]["points_per_extra_epoch_s"] is None

    # resumed, the journal's stop stands while what stopped it is among the sizes again ...
    calls.clear()
    resumed = ResolutionTuner(index, base, [48, 96], epochs=4, journal=journal, resume=True)
    resumed.n_val = 360
    resumed.run()
    assert calls == [] and resumed.trials == tuner.trials
    # ... and without 48 px, 96 px is trained again: nothing before it is ahead any more
    resumed = ResolutionTuner(index, base, [96], epochs=4, journal=journal, resume=True)
    resumed.n_val = 360
    resumed.run()
    assert calls == [96] and resumed.trials[1].stopped_after is None

    # 64 px leads 96 px by more than the noise at equal compute, but is still at chance (2 SE
    # above 33% is 38%): no size has started to learn, so none is stopped
    calls.clear()
    monkeypatch.setattr(resolution_tuner, "fit", replay(
        {64: [0.30, 0.37, 0.37, 0.37], 48: [0.30] * 7, 96: [0.30, 0.60]}, calls))
    tuner = ResolutionTuner(index, base, [48, 96], epochs=4)
    tuner.n_val = 360
    tuner.run()
    assert [len(t.val_curve) for t in tuner.trials] == [7, 4, 2]
    assert all(t.stopped_after is None for t in tuner.trials)


def test_a_one_epoch_trial_behind_is_finished_not_stopped(tmp_path, monkeypatch):
    """A large size's one-epoch trial has its rung at its last epoch, where stopping saves
    nothing: recorded as stopped, it would lose its weights and its trade-off row, and be left
    out of the pick, for no compute saved."""
    import resolution_tuner
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    base = BASE.__class__(**{**BASE.to_dict(), "image_size": 64})
    calls = []
    monkeypatch.setattr(resolution_tuner, "fit", replay(
        {64: [0.33, 0.60, 0.70, 0.75], 128: [0.40]}, calls))
    tuner = ResolutionTuner(index, base, [128], epochs=4)
    tuner.n_val = 360
    assert tuner.epochs_for(128) == tuner.rung(128) == 1
    assert tuner.run() == 64
    big = next(t for t in tuner.trials if t.image_size == 128)
    assert big.stopped_after is None and big.val_curve == [0.40]
    assert next(r for r in tuner.tradeoff() if r["image_size"] == 128)["stopped_after"] is None


def test_the_least_the_trials_train_counts_each_size_to_its_rung(tmp_path):
    """What the measuring budget is a share of: the default size's trial in full, every other
    size to where it can first be stopped, in epochs at the default size."""
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    base = BASE.__class__(**{**BASE.to_dict(), "image_size": 64})
    # 48 px: 4 of 7 epochs, 2.25 at 64 px; 96 px: 1 of 2, 2.25; 128 px: its single epoch, 4
    assert ResolutionTuner(index, base, [48, 96], epochs=4).least_compute() == 4 + 2.25 + 2.25
    assert ResolutionTuner(index, base, [128], epochs=4).least_compute() == 4 + 4


def failing(fit, sizes, error):
    """fit, but the trial at each size in `sizes` raises error() after its first epoch."""
    def run(index, config, on_epoch=None):
        if config.image_size not in sizes:
            return fit(index, config, on_epoch=on_epoch)
        on_epoch(1, {"val_acc": 0.76, "epoch_s": 1.0, "samples_per_s": 100.0})  # not behind
        raise error()
    return run


@pytest.mark.parametrize("error, reason", [
    (lambda: __import__("modules.trainer").trainer.DivergedError("training diverged: NaN"),
     "diverged"),
    (lambda: torch.OutOfMemoryError("CUDA out of memory (simulated)"), "out of memory"),
])
def test_a_size_that_diverges_or_does_not_fit_is_left_out_not_the_whole_scenario(
        tmp_path, monkeypatch, error, reason):
    """The finished sizes still pick; the failed one is journaled, so a resume does not train
    it again to fail again. The default size has no fallback: its failure is the run's."""
    import resolution_tuner
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    base = BASE.__class__(**{**BASE.to_dict(), "image_size": 64})
    calls = []
    curves = {64: [0.50, 0.60, 0.70, 0.75], 48: [0.50, 0.60, 0.70, 0.75, 0.76, 0.77, 0.78]}
    monkeypatch.setattr(resolution_tuner, "fit", failing(replay(curves, calls), {96}, error))
    journal = tmp_path / "resolution.tuning.json"
    tuner = ResolutionTuner(index, base, [48, 96], epochs=4, journal=journal)
    tuner.n_val = 360
    assert tuner.run() == 64
    failed = tuner.trials[2]
    assert (failed.image_size, failed.failed, failed.stopped_after) == (96, reason, None)
    assert tuner.tradeoff()[2]["failed"] == reason
    assert tuner.save_plot(tmp_path / "tradeoff.png").exists()

    calls.clear()
    resumed = ResolutionTuner(index, base, [48, 96], epochs=4, journal=journal, resume=True)
    resumed.n_val = 360
    assert resumed.run() == 64 and calls == [] and resumed.trials == tuner.trials

    monkeypatch.setattr(resolution_tuner, "fit", failing(replay(curves, calls), {64}, error))
    with pytest.raises(type(error())):
        ResolutionTuner(index, base, [48], epochs=4).run()


def test_a_size_that_fails_in_its_first_epoch_records_nulls_not_zeros(tmp_path, monkeypatch):
    """Nothing was measured: its accuracy, speed and epoch time read 0 in the row and journal."""
    import resolution_tuner
    from modules.trainer import DivergedError
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    base = BASE.__class__(**{**BASE.to_dict(), "image_size": 64})
    fit = replay({64: [0.50, 0.60, 0.70, 0.75]}, [])

    def run(index, config, on_epoch=None):
        if config.image_size == 96:
            raise DivergedError("training diverged: NaN")
        return fit(index, config, on_epoch=on_epoch)
    monkeypatch.setattr(resolution_tuner, "fit", run)
    journal = tmp_path / "resolution.tuning.json"
    tuner = ResolutionTuner(index, base, [96], epochs=4, journal=journal)
    tuner.n_val = 360
    assert tuner.run() == 64
    row = tuner.tradeoff()[1]
    assert (row["val_acc"], row["samples_per_s"], row["epoch_s"], row["failed"]) == (
        None, None, None, "diverged")
    assert tuner.save_plot(tmp_path / "tradeoff.png").exists()
    resumed = ResolutionTuner(index, base, [96], epochs=4, journal=journal, resume=True)
    resumed.n_val = 360
    assert resumed.run() == 64 and resumed.trials == tuner.trials


def test_the_final_run_is_said_to_start_from_the_trials_best_epoch(caplog):
    """The trial's weights are its best validation epoch's: the log said "4 epochs in" where
    they were epoch 1's."""
    import scenario
    config = BASE.__class__(**{**BASE.to_dict(), "image_size": 48})
    with caplog.at_level("INFO"):
        _, warm = scenario.warm_start(config, "resolution", "the 48 px trial",
                                      __import__("pathlib").Path("w.pt"), 4,
                                      [(1.0, 0.211), (2.0, 0.167), (3.0, 0.175), (4.0, 0.167)])
    assert warm["best_epoch"] == 1 and warm["trial_epochs"] == 4
    assert "best validation epoch (1 of 4)" in caplog.text


def test_a_size_left_out_is_said_once_and_not_trained(tmp_path, monkeypatch, caplog):
    import resolution_tuner
    index = index_dataset(make_folder(tmp_path / "d", n_train=4, n_test=2))
    calls = []
    monkeypatch.setattr(resolution_tuner, "fit", replay({64: [0.5] * 4, 256: [0.9]}, calls))
    tuner = ResolutionTuner(index, BASE.__class__(**{**BASE.to_dict(), "image_size": 64}),
                            [256], epochs=4)
    assert tuner.run() == 64 and calls == [64]
    assert caplog.text.count("256 px left out: one epoch there costs more than twice") == 1

