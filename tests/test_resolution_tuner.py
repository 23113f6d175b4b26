"""ResolutionTuner: one short run per size, the pick, ties to the cheaper size, the trade-off."""
import pytest

from conftest import make_folder
from modules.config import TrainConfig, UserError
from modules.dataset import index_dataset
from resolution_tuner import ResolutionTrial, ResolutionTuner

BASE = TrainConfig(model="resnet18", weights="none", epochs=2, batch_size=8, device="cpu",
                   progress=False, seed=0)


def trial(size, acc, epoch_s=1.0):
    return ResolutionTrial(image_size=size, val_acc=acc, samples_per_s=100.0, epoch_s=epoch_s,
                           wall_s=2 * epoch_s)


def test_pick_takes_the_most_accurate_size():
    assert ResolutionTuner.pick([trial(32, 0.5), trial(48, 0.8), trial(64, 0.7)], 0.01) == 48


def test_a_tie_within_noise_goes_to_the_cheaper_size():
    trials = [trial(64, 0.795), trial(48, 0.79), trial(96, 0.80)]
    assert ResolutionTuner.pick(trials, 0.01) == 48
    assert ResolutionTuner.pick(trials, 0.001) == 96


def test_runs_every_candidate_and_reports_the_tradeoff(tmp_path):
    index = index_dataset(make_folder(tmp_path / "d", n_train=10, n_test=3))
    tuner = ResolutionTuner(index, BASE, [32, 24])
    best = tuner.run()
    assert [t.image_size for t in tuner.trials] == [24, 32] and best in (24, 32)
    assert all(0 <= t.val_acc <= 1 and t.samples_per_s > 0 and t.epoch_s > 0 for t in tuner.trials)
    # one validation image is the noise floor: 6 val images here, so ties within 1/6
    assert tuner.tolerance == pytest.approx(1 / len(index.val))
    rows = tuner.tradeoff()
    assert rows[0]["points_per_extra_epoch_s"] is None and "val_acc" in rows[1]
    assert tuner.save_plot(tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


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
                        lambda idx, cfg: trained.append(cfg.image_size) or real_fit(idx, cfg))
    resumed = ResolutionTuner(index, BASE, [24, 32], journal=journal, resume=True)
    resumed.run()
    assert trained == [32] and resumed.reused == [24]
    assert resumed.trials[0] == first.trials[0]  # the journaled result, as it was
    assert len(json.loads(journal.read_text())["trials"]) == 2

    # progress bars change nothing measured: still reused
    trained.clear()
    quiet = BASE.__class__(**{**BASE.to_dict(), "progress": not BASE.progress})
    ResolutionTuner(index, quiet, [24, 32], journal=journal, resume=True).run()
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
    other = index_dataset(make_folder(tmp_path / "e", n_train=10, n_test=3))
    ResolutionTuner(other, BASE, [24], journal=journal, resume=True).run()
    assert trained == [24]
    journal.write_text("{not json")
    trained.clear()
    ResolutionTuner(index, BASE, [24], journal=journal, resume=True).run()
    assert trained == [24]
