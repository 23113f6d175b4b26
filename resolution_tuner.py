"""ResolutionTuner: trains about the same compute at each candidate input size (more epochs for
smaller sizes), always including the default size, and picks the size with the best validation
accuracy: a size within one standard error of the best ties, and a tie keeps the default size
when it is among the tied, else goes to the cheapest. The default size trains first; a later
size is stopped at half its compute when a size trained before it was clearly ahead with no
more compute (successive halving with compute as the resource). It reports what each size costs.
With a journal, every size tried is written down (a stopped one with where it stopped), and a
resumed run trains only the sizes it has no result for; with a weights folder each finished
size's trained weights are kept, so the final run can continue from the picked size's trial.
A size other than the default whose trial diverges or does not fit in memory is recorded as
failed, left out of the pick, and not tried again on resume."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules import distributed
from modules.checkpoints import save_weights
from modules.config import TrainConfig, UserError, first_line
from modules.dataset import DatasetIndex
from modules.device import resolve_device
from modules.files import atomic_save_figure, atomic_write_text, io_failed
from modules.oom import release
from modules.report import figure, finite_number
from modules.selection import (accuracy_se, beats, chance_words, clearly_ahead, informative,
                              ties, validation_chance)
from modules.trainer import DivergedError, fit, trial_failure

log = logging.getLogger(__name__)

GPU_RESOLUTIONS = (144, 160, 176, 192)
# On a CPU, time per image grows with the pixel count: 192 px costs about 9x what 64 px does.
CPU_RESOLUTIONS = (64, 96, 128)
QUICK_CPU_RESOLUTIONS = (48, 64, 96)


@dataclass
class ResolutionTrial:
    image_size: int
    val_acc: float | None        # best validation accuracy within the budget, 0-1
    samples_per_s: float | None  # training throughput after warm-up
    epoch_s: float | None        # mean seconds per epoch, validation included
    wall_s: float         # the whole short run, seconds
    val_curve: list[float] = field(default_factory=list)  # validation accuracy after each epoch
    stopped_after: int | None = None  # the epoch it was stopped at, behind (None: it finished)
    epoch_end_at: list[float] = field(default_factory=list)  # time.time() after each epoch
    failed: str | None = None  # why it could not train (diverged, out of memory); None: it did


class _Behind(Exception):
    """Raised from a trial's epoch hook to stop a size that is clearly behind."""


class ResolutionTuner:
    """Which input size buys the most accuracy for the time: one short run per candidate."""

    def __init__(self, index: DatasetIndex, base: TrainConfig, resolutions=GPU_RESOLUTIONS, *,
                 epochs: int | None = None, journal: str | Path | None = None,
                 resume: bool = False, weights_dir: str | Path | None = None):
        """base.image_size is the default size, always a candidate. journal: a JSON file where
        each finished size's result is kept; with resume=True the sizes it holds for the same
        settings and data are taken from it, not trained again. weights_dir: where each size's
        trial keeps its best weights (weights_for)."""
        sizes = sorted(set(int(r) for r in resolutions) | {base.image_size})
        for size in sizes:  # TrainConfig checks each size against the model's minimum
            dataclasses.replace(base, image_size=size)
        self.epochs = epochs or base.epochs
        self.index, self.base = index, base
        self.resolutions = comparable_sizes(sizes, base.image_size, self.epochs)
        self.left_out = [s for s in sizes if s not in self.resolutions]  # said by run()
        self.default_size, self.n_val = base.image_size, len(index.val)
        self.chance = validation_chance(index)
        self.journal, self.resume = (Path(journal) if journal else None), resume
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.trials: list[ResolutionTrial] = []
        self.reused: list[int] = []  # sizes taken from the journal on resume

    def run(self) -> int:
        """Train every candidate (on resume, those the journal has no result for; a size
        clearly behind by half its compute is stopped there); return the picked size."""
        self.trials, self.reused = [], []
        if self.left_out:
            log.warning("resolution: %s px left out: one epoch there costs more than twice the "
                        "compute the sizes are compared at (%d epochs at %d px); more --epochs "
                        "would include %s", ",".join(map(str, self.left_out)), self.epochs,
                        self.default_size, "it" if len(self.left_out) == 1 else "them")
        data = self.index.fingerprint(("train", "val"))  # what a trial's result depends on
        # Under torchrun every rank trains each size with the others (data-parallel), so all
        # take rank 0's journal and pick.
        done = distributed.from_main(self._journaled() if self.resume and
                                     distributed.is_main() else {})
        entries = []
        for size in self.training_order():
            config = self.trial_config(size)
            key = _config_key(config)
            trial = done.get(key)
            if trial is not None and trial.stopped_after is not None and \
                    self._ahead(self.trials, size, trial.val_acc) is None:
                trial = None  # what stopped it is not among this run's sizes: train it again
            if trial is not None:
                self.reused.append(size)
                log.info("resolution %d px: %s (from %s, not trained again)", size,
                         trial.failed or f"val accuracy {100 * trial.val_acc:.1f}%",
                         self.journal)
            else:
                trial = self._train(size, config)
            self.trials.append(trial)
            entries.append({"config": key, "trial": dataclasses.asdict(trial)})
            # what earlier sessions journaled and this one has not reached (or does not try:
            # fewer --resolutions) stays for a later resume
            written = {e["config"] for e in entries}
            self._write_journal(data, entries + [
                {"config": k, "trial": dataclasses.asdict(t)} for k, t in done.items()
                if k not in written])
        self.trials.sort(key=lambda t: t.image_size)
        best = distributed.from_main(
            self.pick(self.trials, self.n_val, self.default_size, self.chance))
        top = max((t for t in self.trials if t.stopped_after is None and t.failed is None),
                  key=lambda t: t.val_acc)  # pick() raised if there is none
        log.info("resolution pick: %d px (best %d px at %.1f%% +- %.1f on %d validation images; "
                 "sizes within one standard error of the difference tie, and a tie keeps the "
                 "default %d px, else the smallest that beats it)", best, top.image_size, 100 * top.val_acc,
                 100 * accuracy_se(top.val_acc, self.n_val), self.n_val, self.default_size)
        return best

    def training_order(self) -> list[int]:
        """The default size first (it is never stopped), then the others from the smallest;
        each is judged against every size trained before it."""
        return [self.default_size] + [s for s in self.resolutions if s != self.default_size]

    def _train(self, size: int, config: TrainConfig) -> ResolutionTrial:
        rows: list[dict[str, float]] = []
        ended: list[float] = []
        rung = self.rung(size)

        def on_epoch(epoch: int, row: dict[str, float]) -> None:
            rows.append(row)
            ended.append(time.time())
            if epoch == rung and epoch < config.epochs:
                ahead = self._ahead(self.trials, size, max(r["val_acc"] for r in rows))
                # every rank stops, or goes on, as rank 0 decides
                by = distributed.from_main(None if ahead is None else (
                    ahead.image_size, self._best_within(ahead, self._rung_compute(size))))
                if by is not None:
                    raise _Behind(*by)

        started = time.perf_counter()
        stop = failed = None
        try:
            result = fit(self.index, config, on_epoch=on_epoch)
        except _Behind as behind:
            result, stop = None, behind.args
        except (DivergedError, RuntimeError) as exc:  # torch's OutOfMemoryError: a RuntimeError
            failed = trial_failure(exc)
            if failed is None or size == self.default_size:  # the default has no fallback
                raise
            result = None
            log.warning("resolution %d px: %s; left out of the pick (%s)", size, failed,
                        first_line(exc))
        if failed is not None:
            # Outside the except block, whose traceback holds the trial's model and batches.
            release(resolve_device(config.device))
        curve = [r["val_acc"] for r in rows]
        # A trial that failed in its first epoch measured nothing: null, not 0.
        trial = ResolutionTrial(
            image_size=size, val_acc=max(curve, default=None),
            samples_per_s=finite_number((result.timing if result else rows[-1] if rows else {})
                                        .get("samples_per_s")),
            epoch_s=sum(r["epoch_s"] for r in rows) / len(rows) if rows else None,
            wall_s=result.wall_s if result else time.perf_counter() - started,
            val_curve=curve, stopped_after=None if result or failed else len(rows),
            epoch_end_at=ended, failed=failed)
        if failed is not None:
            return trial
        if stop is not None:
            log.info("resolution %d px: stopped after epoch %d of %d at %.1f%%: %d px had %.1f%% "
                     "with no more compute, ahead by more than one standard error of the "
                     "difference", size, len(rows), config.epochs, 100 * trial.val_acc,
                     stop[0], 100 * stop[1])
            return trial
        if self.weights_dir is not None and distributed.is_main():
            try:
                save_weights(result.model, self._weights_path(size))
            except OSError as exc:  # the final run then starts from the beginning
                log.warning("resolution %d px: could not keep the trial's weights (%s); a final "
                            "run at this size trains from the start", size, first_line(exc))
        log.info("resolution %d px: val accuracy %.1f%%, %.0f img/s, %.1f s per epoch",
                 size, 100 * trial.val_acc, trial.samples_per_s, trial.epoch_s)
        return trial

    def rung(self, size: int) -> int:
        """The first epoch by which the trial at `size` has had at least half its compute."""
        return max(1, math.ceil(self.epochs_for(size) / 2))

    def least_compute(self) -> float:
        """The least the trials train, in epochs at the default size: the default's in full,
        every other size up to its rung (a one-epoch trial's rung is its whole trial)."""
        return self.epochs + sum(self._rung_compute(s) for s in self.resolutions
                                 if s != self.default_size)

    def _rung_compute(self, size: int) -> float:
        """The compute by the trial's rung, in epochs at the default size."""
        return self.rung(size) * (size / self.default_size) ** 2

    def _best_within(self, trial: ResolutionTrial, compute: float) -> float:
        """The trial's best validation accuracy in the epochs it trained with no more than
        `compute` (epochs at the default size); 0 when there are none."""
        epochs = int(compute / (trial.image_size / self.default_size) ** 2 + 1e-9)
        return max(trial.val_curve[:epochs], default=0.0)

    def _ahead(self, earlier: list[ResolutionTrial], size: int, acc: float
               ) -> ResolutionTrial | None:
        """A size trained before whose best accuracy with no more compute than the trial at
        `size` had by its rung is clearly ahead of `acc` (clearly_ahead); None when there is
        none."""
        compute = self._rung_compute(size)
        earlier = [t for t in earlier if t.failed is None]  # a diverged curve leads nothing
        top = max(earlier, key=lambda t: self._best_within(t, compute), default=None)
        at = self._best_within(top, compute) if top is not None else 0.0
        return top if clearly_ahead(at, acc, self.n_val, self.chance) else None

    def weights_for(self, size: int) -> tuple[Path | None, int]:
        """(the weights the trial at `size` ended with, its best validation epoch's; its
        epochs), or (None, 0) when none were kept."""
        path = self._weights_path(size)
        if path is not None and not path.exists():
            # named by size alone before 6f4d200: a resumed run of that version keeps its own
            path = path.with_name(f"resolution-{size}px.weights.pt")
        if path is None or not path.exists():
            return None, 0
        return path, self.epochs_for(size)

    def _weights_path(self, size: int) -> Path | None:
        """Named by the trial's settings, as the journal keys its results: a resume back on
        settings an earlier session trained (after one with another --lr) reuses their
        journaled result, and must find their weights, not the other session's at that size."""
        if self.weights_dir is None:
            return None
        digest = hashlib.sha256(_config_key(self.trial_config(size)).encode()).hexdigest()[:10]
        return self.weights_dir / f"resolution-{size}px-{digest}.weights.pt"

    def trial_config(self, size: int) -> TrainConfig:
        """What the trial at `size` trains."""
        return self.base.as_trial(image_size=size, epochs=self.epochs_for(size))

    def epochs_for(self, size: int) -> int:
        """Every size gets about the same compute: `epochs` at the default size, scaled by the
        pixel count, so the sizes are compared at equal compute, as the final run spends it
        (scenario.fill_time)."""
        return equal_compute_epochs(self.epochs, self.default_size, size)

    def _journaled(self) -> dict[str, ResolutionTrial]:
        """{config key: trial} from the journal, for the same data; {} when there is none or it
        cannot be read (then every size is trained)."""
        if self.journal is None or not self.journal.exists():
            return {}
        try:
            saved = json.loads(self.journal.read_text())
            if not self.index.same_data(saved["data"], ("train", "val")):
                log.info("resolution tuning: the data changed since %s; training every size",
                         self.journal)
                return {}
            # keys written before a setting existed read as its default
            return {_config_key(TrainConfig(**json.loads(e["config"]))): ResolutionTrial(**e["trial"])
                    for e in saved["trials"]}
        except (OSError, ValueError, KeyError, TypeError, UserError) as exc:
            if (failed := io_failed(self.journal, exc)) is not None:
                raise failed from None  # the sizes it holds would all be trained again
            log.info("resolution tuning: cannot reuse %s (%s); training every size",
                     self.journal, exc)
            return {}

    def _write_journal(self, data: str, entries: list[dict[str, Any]]) -> None:
        """Rank 0 alone writes, so a failure (a full disk) is not raised: the other ranks
        would go on into the next trial's collectives and fail there with a traceback. The
        journal only spares a resume the sizes done."""
        if self.journal is not None and distributed.is_main():
            try:
                atomic_write_text(json.dumps({"data": data, "trials": entries}, indent=2,
                                             allow_nan=False), self.journal)
            except OSError as exc:
                log.warning("resolution tuning: could not write %s (%s); a resume trains these "
                            "sizes again", self.journal, first_line(exc))

    @staticmethod
    def pick(trials: list[ResolutionTrial], n_val: int, default_size: int | None = None,
             chance: float | None = None) -> int:
        """Among the sizes that finished their trial, those whose accuracy ties with the best
        one (within one standard error of the difference on n_val images): the default size if
        it is one, else the smallest of those that beat the default by more than that.
        The default size also stays when its own trial is still at chance and no other size
        has left chance ahead of it (chance given, as chance_level): then the short trials rank
        nothing.
        A size that has left chance at the same compute is ahead, as the final run spends it,
        and the pick is then among the sizes clear of chance."""
        # a stopped size was judged already (behind); a failed one has nothing to judge
        trials = [t for t in trials if t.stopped_after is None and t.failed is None]
        if not trials:
            raise UserError("no resolution was tried.")
        default = next((t for t in trials if t.image_size == default_size), None)

        def left_chance(t: ResolutionTrial) -> bool:
            # and stayed out: a size's best of several epochs at chance is sometimes one
            # lucky epoch above it (a smaller size trains more epochs, so draws more often)
            return informative(t.val_acc, n_val, chance) and (
                not t.val_curve or informative(t.val_curve[-1], n_val, chance))
        if default is not None and chance is not None and not left_chance(default):
            if not any(left_chance(t) and beats(t.val_acc, default.val_acc, n_val)
                       for t in trials):
                log.info("resolution: every size's trial is still at %s, the default's at "
                         "%.1f%%: the short trials cannot rank the sizes; keeping the default",
                         chance_words(chance), 100 * default.val_acc)
                return default_size
            log.info("resolution: the default size's trial (%.1f%%) is still at %s, and a "
                     "size that cost the same has left it", 100 * default.val_acc,
                     chance_words(chance))
            # the pick is among the sizes clear of chance: one still at chance that ties with
            # the leader by noise is no better ranked than the default
            trials = [t for t in trials if left_chance(t)]
        top = max(t.val_acc for t in trials)
        tied = [t for t in trials if ties(top, t.val_acc, n_val)]
        if default in tied:
            return default_size
        if default is not None:  # a size level with the default does not replace it, even
            # when it ties with a leader that beats the default (ties are not transitive)
            tied = [t for t in tied if t.val_acc > default.val_acc
                    and not ties(t.val_acc, default.val_acc, n_val)]
        return min(t.image_size for t in tied)

    def tradeoff(self) -> list[dict[str, Any]]:
        """Per size: accuracy, speed, and accuracy gained per extra second of epoch time
        relative to the smallest size that finished (none for a stopped or failed size: its
        accuracy is from part of its compute, and its speed from its first epochs, warm-up
        included)."""
        rows = []
        first = next((t for t in self.trials if t.stopped_after is None and t.failed is None),
                     None)
        for t in self.trials:
            extra_s = t.epoch_s - first.epoch_s if t.stopped_after is None and \
                t.failed is None else 0
            gain = (t.val_acc - first.val_acc) / extra_s if extra_s > 0 else None
            trial = {k: v for k, v in dataclasses.asdict(t).items() if k != "epoch_end_at"}
            rows.append({**trial, "points_per_extra_epoch_s":
                         100 * gain if gain is not None else None})
        return rows

    def save_plot(self, path: str | Path) -> Path | None:
        """Validation accuracy against seconds per epoch, one labelled point per size (a
        stopped size's is where it stopped)."""
        if not self.trials:
            return None
        fig = figure(6, 4.5, dpi=120)
        ax = fig.add_subplot()
        shown = [t for t in self.trials if t.val_curve]  # a size that failed in its first epoch
        xs = [t.epoch_s for t in shown]
        ys = [100 * t.val_acc for t in shown]
        ax.plot(xs, ys, "-o")
        for t, x, y in zip(shown, xs, ys):
            label = f"{t.image_size} px" + (
                f" ({t.failed})" if t.failed else "" if t.stopped_after is None else
                f" (stopped after epoch {t.stopped_after})")
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5))
        ax.set_xlabel("seconds per epoch")
        ax.set_ylabel("validation accuracy (%)")
        ax.set_title("Resolution: accuracy for the time")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = Path(path)
        atomic_save_figure(fig, path)
        return path


def comparable_sizes(sizes: list[int], default_size: int, epochs: int) -> list[int]:
    """The sizes a trial can train at about the compute of `epochs` at the default size: the
    default, and every other whose one epoch costs at most twice that (a trial trains whole
    epochs, so a size past it would lead on compute, not size)."""
    return [s for s in sizes if s == default_size or epochs * (default_size / s) ** 2 >= 0.5]


def equal_compute_epochs(epochs: int, default_size: int, size: int) -> int:
    """The epochs at `size` that cost about what `epochs` cost at `default_size`: a step's
    cost grows with the pixel count (at least one epoch)."""
    return max(1, round(epochs * (default_size / size) ** 2))


def _config_key(config: TrainConfig) -> str:
    """What one trial learns, as a string: a journaled result is reused only for equal
    settings. Not the speed knobs: a resume on another machine (Colab's next VM) measures them
    again, and a knob measured otherwise there trained every size again, whose noisy pick
    could then differ from the final run's checkpoint, which refused to resume."""
    return json.dumps(config.learning_settings(), sort_keys=True)

