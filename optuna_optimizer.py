"""Optuna hyperparameter search over the trainer: the default configuration as the first
trial, successive halving over epochs, a persistent (resumable, crash-tolerant) RDB study,
out-of-memory trials recorded as pruned, and plots."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import socket
import time
import warnings
from pathlib import Path

import optuna
from matplotlib.ticker import MaxNLocator

import modules.storage
from modules import distributed
from modules.checkpoints import save_weights
from modules.config import OPTIMIZERS, TrainConfig, UserError, first_line
from modules.dataset import steps_per_epoch
from modules.files import atomic_save_figure, atomic_write_text, kept_file
from modules.oom import release
from modules.report import figure, write_html
from modules.selection import (accuracy_se, beats, chance_words, informative, tie_margin,
                              validation_chance)
from modules.device import resolve_device
from modules.storage import (Storage, copy_sqlite, opened, retry_callback, scrub, sqlite_url,
                             storage_cause, storage_error, without_password)
from modules.trainer import DivergedError, fit, trial_failure

log = logging.getLogger(__name__)

# asha: Optuna's asynchronous successive halving, epochs as the resource (the first rung at two
# thirds of a trial's epochs, then 3x that ..., each keeping the top third of the trials that
# reached it); hyperband runs such brackets (with trials this short, one); median stops a trial
# below the median of earlier ones at the same epoch. The first rung is late: from scratch,
# learning curves cross in the first epochs (a lower learning rate leaves the starting plateau
# later, then overtakes). Before it, a trial that has itself left chance can be stopped at
# epochs 1, 3, 9 ... (early_rungs): from pretrained weights every curve leaves it at once.
# none: every trial trains its whole budget (plain TPE, for comparison).
PRUNERS = ("asha", "hyperband", "median", "none")
REDUCTION_FACTOR = 3
MEDIAN_WARMUP = 1  # epochs the median pruner lets every trial train
BATCH_SIZES = (16, 32, 64, 128, 256)  # the search's choices, before the memory bound
# A trial within this share over the default trial's optimizer steps took no more of them
# (_judged_epochs): a short last batch, dropped each epoch, gives a small batch under one step
# an epoch more than the batch ratio, which must not halve the epochs it is judged at (batch 16
# after 2 of 4 epochs took 150 steps over 1,200 images, the default batch 32's trial 148).
STEP_SLACK = 0.05


@dataclasses.dataclass
class EarlierTrial:
    """A short run trained before the search (the resolution scenario's trial at the size the
    search runs at). When it trained exactly what the default trial would, the search takes
    its result as the default trial instead of training the same thing again."""
    config: TrainConfig       # what it trained
    val_curve: list[float]    # validation accuracy after each epoch
    weights: Path | None      # the weights it ended with
    wall_s: float
    samples_per_s: float
    source: str               # for the log: "the resolution scenario's 64 px trial"
    epoch_end_at: list[float] = dataclasses.field(default_factory=list)  # time.time() each


def first_rung(epochs: int) -> int:
    """Where successive halving first compares trials of `epochs`: two thirds of them. From
    scratch a good configuration can sit at chance for half its epochs and then lead, and a
    trial stopped there also tells the sampler that its region is poor (docs/tuning.md)."""
    return max(1, math.ceil(2 * epochs / 3))


def early_rungs(epochs: int) -> list[int]:
    """The epochs before the first rung at which a trial that has itself left chance can be
    stopped already: 1, 3, 9 ... (successive halving's own spacing). From pretrained weights
    every curve leaves chance in the first epoch, and waiting for two thirds of each trial
    stopped the poor ones only in their last third (docs/tuning.md)."""
    late, rungs, r = first_rung(epochs), [], 1
    while r < late:
        rungs.append(r)
        r *= REDUCTION_FACTOR
    return rungs


class _BeyondNoise(optuna.pruners.BasePruner):
    """`pruner`, whose stop holds only when the trial is clearly behind: some trial at the same
    epoch beats it by more than one standard error of the difference on the validation set,
    and some trial has left chance (two standard errors above chance_level) at that epoch.
    Before that, ranking prunes by noise: from scratch, good configurations can sit at chance
    for an epoch or two, and with few trials at a rung successive halving keeps only the top
    one, however close the next.

    At the `early` epochs, before `pruner`'s first rung, the same rule (outside the top third
    of the trials at that epoch, and clearly behind) stops a trial only once it has itself left
    chance: a trial still at chance may be one that leaves it late and then leads."""

    def __init__(self, pruner: optuna.pruners.BasePruner, n_val: int, chance: float,
                 epochs: int, early: list[int] | tuple[int, ...] = ()):
        self.pruner, self.n_val, self.chance = pruner, n_val, chance
        self.epochs, self.early = epochs, tuple(early)

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        # The default trial is what every winner is judged against (choice): stopped (on a
        # shared study, by another worker's faster trial), none would be, and the default
        # would be kept however far behind. It is asked all the same, so that successive
        # halving records its rungs, the yardstick of the others.
        stop = self._prune(study, trial)
        return stop and not trial.user_attrs.get("default")

    def _prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        # At its last epoch a trial has cost all it will: stopping it saves nothing and would
        # tell the sampler a finished result is poor. (Successive halving, first asked once a
        # trial has left chance, can be asked that late.)
        if step is None or step >= self.epochs:
            return False
        # Not a trial cut off with its session (FAIL): its retry, the same parameters, is here
        # too, and one configuration would count twice in the ranking.
        here = [t.intermediate_values[step] for t in study.get_trials(deepcopy=False)
                if step in t.intermediate_values and t.state != optuna.trial.TrialState.FAIL]
        leader, value = max(here), trial.intermediate_values[step]
        if step in self.early:
            if not informative(value, self.n_val, self.chance):
                return False
            return _outside_top(value, here) and beats(leader, value, self.n_val)
        # clearly_ahead, in two parts. Successive halving is asked at every epoch, whatever
        # the answer will be: it records a trial's rung value at the first epoch it is asked
        # past the rung, and trials must be ranked at the rung's own epoch. Its stop holds
        # only once some trial has left chance here, and this one is clearly behind.
        verdict = self.pruner.prune(study, trial)
        # Its ranking reads every trial's rungs, FAIL ones too (see above): at a rung it has
        # just recorded, the trial is ranked again without them. (Hyperband reads them the same
        # way; here it has one bracket, _rungs_passed.)
        trials = study.get_trials(deepcopy=False)
        now = next(t for t in trials if t.number == trial.number).system_attrs
        rungs = [k for k in now if k.startswith("completed_rung_") and k not in trial.system_attrs]
        if rungs:
            verdict = any(_outside_top(now[k], [t.system_attrs[k] for t in trials
                                                if k in t.system_attrs
                                                and t.state != optuna.trial.TrialState.FAIL])
                          for k in rungs)
        if not informative(leader, self.n_val, self.chance):
            return False
        return verdict and beats(leader, value, self.n_val)


def _outside_top(value: float, values: list[float]) -> bool:
    """Successive halving's promotion rule, failed: `value` is not in the top third of the
    `values` at a rung (its own among them); with fewer than six, not the best."""
    return value < sorted(values, reverse=True)[max(0, len(values) // REDUCTION_FACTOR - 1)]


def _trained(trial) -> bool:
    """False for a trial drawn at a batch the search leaves out, stopped before it trained
    (objective): not a trial in any count."""
    return not trial.user_attrs.get("untrained")


class OptunaTuner:
    """An Optuna study maximising validation accuracy over training hyperparameters."""

    SEARCHED = ("lr", "batch_size", "optimizer", "weight_decay")  # see distributions()
    LR_RANGE, WEIGHT_DECAY_RANGE = (1e-4, 1e-2), (1e-6, 1e-2)
    OPTIMIZERS = OPTIMIZERS  # every optimizer the trainer has

    def __init__(self, index, base: TrainConfig, *, output_dir, n_trials: int = 10,
                 timeout_s: float | None = None, storage: str | None = None,
                 study_name: str = "hpo", pruner: str = "asha", resume: bool = False,
                 epochs: int | None = None,
                 batch_sizes: tuple[int, ...] = BATCH_SIZES,
                 max_batch_size: int | None = None, seed: int | None = None,
                 local_dir: str | Path | None = None, data_fingerprint: str | None = None,
                 overwrite: bool = False, weights_dir: str | Path | None = None,
                 earlier: EarlierTrial | None = None, study_count: bool = False,
                 shared: bool = False, final_size: int | None = None,
                 keep_study_size: bool = False, run_name: str | None = None,
                 sole_user: bool = False, auto_budget: bool = False):
        """n_trials: the study's size (on a shared --storage, this worker's trials); with
        study_count and resume, a study's own count (what it was asked for) wins over it.
        shared: other workers search the study too (the user gave --storage, whatever the
        database): it is joined when it exists, and never deleted. final_size: the size the
        final run trains at, when the trials train at a smaller one (base.image_size, a
        cheaper look): a kept default continues from the earlier trial at that size, and the
        chosen trial's epoch seconds are scaled to it (final_epoch_seconds). keep_study_size:
        the trials' size was not the user's choice, so a resumed or joined study whose trials
        trained at another size (a version with another rule) goes on at that size.
        run_name: names this run over its sessions (output dir and run id), so that on a
        shared study a resumed worker counts the trials it ran before as its own.
        sole_user: no other process can be running the study's trials (the pipeline holds the
        output dir's lock on a study of its own): a trial still RUNNING on resume was cut off
        with the last session and is retried at once, not after the heartbeat's grace.
        auto_budget: timeout_s is not the user's but a share of the baseline's time; resumed
        with study_count, the study keeps the budget it was started with (none when it was
        started with a count)."""
        if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
            raise UserError(f"n_trials must be an integer >= 1, but got n_trials={n_trials!r}.")
        if timeout_s is not None and (isinstance(timeout_s, bool)
                                      or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0 or timeout_s == float("inf")):
            raise UserError(f"timeout_s must be a finite number > 0 or None, but got "
                            f"timeout_s={timeout_s!r}.")
        if pruner not in PRUNERS:
            raise UserError(f"pruner must be one of {', '.join(PRUNERS)}, but got {pruner!r}.")
        epochs = base.epochs if epochs is None else epochs
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise UserError(f"epochs must be an integer >= 1 (every trial's budget), but got "
                            f"epochs={epochs!r}.")
        self.batch_sizes = tuple(b for b in batch_sizes
                                 if max_batch_size is None or b <= max_batch_size)
        self.searchable_batch_sizes = tuple(batch_sizes)  # before this GPU's memory bound
        if not self.batch_sizes:
            raise UserError(f"no batch size in {tuple(batch_sizes)} fits "
                            f"max_batch_size={max_batch_size!r}.")
        # Every trial trains the same epochs, so trials are compared at equal budgets.
        self.index, self.base, self.epochs = index, base, epochs
        self.n_train = len(index.train)  # what a trial's steps are counted over (_judged_epochs)
        # A batch whose first epoch alone takes more optimizer steps than the default trial's
        # epochs cannot be judged against it (choice): its trials could never win, and would
        # set the bar at equal epochs that prunes the others.
        judged = tuple(b for b in self.batch_sizes if self._judged_epochs(b) >= 1)
        self.unjudged = frozenset(self.batch_sizes) - frozenset(judged) if judged else frozenset()
        if self.unjudged:
            log.info("batch sizes %s left out of the search: over %d-epoch trials, their first "
                     "epoch alone takes more optimizer steps than the default's (batch %d) "
                     "whole trial, so they could not be judged against it",
                     tuple(b for b in self.batch_sizes if b not in judged), epochs,
                     base.batch_size)
            self.batch_sizes = judged
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.n_trials, self.timeout_s, self.resume = n_trials, timeout_s, resume
        self.study_count, self.shared, self.sole_user = study_count, shared, sole_user
        self.keep_study_size, self.auto_budget = keep_study_size, auto_budget
        self.new_trials = 0  # trials the last run() added
        # Marks the trials this process trains: on a shared study others train beside it.
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{time.time()}"
        self.run_name = run_name or self.worker
        self.study_name, self.pruner = study_name, pruner
        # a library caller's study is checked against its data as the pipeline's is
        self.data_fingerprint = data_fingerprint if data_fingerprint is not None else \
            getattr(index, "fingerprint", lambda: None)()
        self.overwrite = overwrite
        # The default trial's weights and the best trial's so far are kept here (weights_for).
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.earlier = earlier  # the default trial's result when it matches (_reused_default)
        self.final_size = final_size or base.image_size
        self.seed = base.seed if seed is None else seed
        # SQLite by default: a file in the output folder outlives a crashed Colab session. With
        # local_dir the file lives there and is copied to the output folder after every trial:
        # SQLite's locking is unsafe on network drives (Google Drive among them).
        self.mirror: tuple[Path, Path] | None = None  # (the local study file, its copy)
        db = self.output_dir / "optuna.db"
        if local_dir is not None and storage is None:
            # One local file per output folder, so two runs on one machine never share it.
            key = hashlib.sha1(os.fsencode(self.output_dir.resolve())).hexdigest()[:12]
            local = Path(local_dir).expanduser() / key / "optuna.db"
            local.parent.mkdir(parents=True, exist_ok=True)
            if db.exists() and (not local.exists() or db.stat().st_mtime > local.stat().st_mtime):
                log.info("restoring the study from %s to %s", db, local)
                copy_sqlite(db, local)
            db, self.mirror = local, (local, db)
        self.storage_url = storage or sqlite_url(db)
        self.storage = self._storage()  # opened now, so a bad URL fails before any training
        self.study: optuna.Study | None = None

    # ------------------------------------------------------------------------- one trial

    def suggest(self, trial) -> TrainConfig:
        """The base config with this trial's hyperparameters (the default trial: the base
        config itself, whose values may lie outside the searched ranges: default_params)."""
        params = {name: trial.suggest_categorical(name, list(space.choices))
                  if isinstance(space, optuna.distributions.CategoricalDistribution)
                  else trial.suggest_float(name, space.low, space.high, log=space.log)
                  for name, space in self.distributions().items()}
        return self._config(params, default=bool(trial.user_attrs.get("default")))

    def _config(self, params: dict, *, default: bool) -> TrainConfig:
        """The base config at `params`; the default trial trains the base's own values, which
        "keeping the default" trains in full (a --lr 0.05 above the searched range, a batch
        between its choices, weight decay 0 below it)."""
        if default:
            params = self.searched(self.base)
        return self.base.as_trial(epochs=self.epochs, **params)

    def default_params(self) -> dict:
        """The base configuration as a point of the search space, which the study records for
        the first trial (its sampler models the space); what it trains is the base's own
        values (_config)."""
        b = self.base
        lr = min(max(b.lr, self.LR_RANGE[0]), self.LR_RANGE[1])
        wd = min(max(b.weight_decay, self.WEIGHT_DECAY_RANGE[0]), self.WEIGHT_DECAY_RANGE[1])
        batch = min(self.batch_sizes, key=lambda n: (abs(n - b.batch_size), n))
        return {"lr": lr, "batch_size": batch, "optimizer": b.optimizer, "weight_decay": wd}

    @classmethod
    def searched(cls, config: TrainConfig) -> dict:
        """`config`'s values of the hyperparameters the search chooses."""
        return {k: getattr(config, k) for k in cls.SEARCHED}

    def default_config(self) -> TrainConfig:
        """What the default trial trains (suggest() at default_params())."""
        return self._config(self.default_params(), default=True)

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        """The search space (suggest() samples it, in this order)."""
        return {"lr": optuna.distributions.FloatDistribution(*self.LR_RANGE, log=True),
                "batch_size": optuna.distributions.CategoricalDistribution(list(self.batch_sizes)),
                "optimizer": optuna.distributions.CategoricalDistribution(list(self.OPTIMIZERS)),
                "weight_decay": optuna.distributions.FloatDistribution(*self.WEIGHT_DECAY_RANGE,
                                                                       log=True)}

    def _reused_default(self) -> optuna.trial.FrozenTrial | None:
        """The earlier trial as the default trial, when it learned the same for the same epochs
        (TrainConfig.learning_settings: the autotuner measures the speed knobs again at the
        search's size, and may pick others; its seconds are then the earlier knobs'); else
        None (the default trial is trained). Trained again, the same settings from scratch can
        end far from the first run, and the search's choice is made against that draw."""
        e = self.earlier
        if e is None or len(e.val_curve) != self.epochs or \
                e.config.learning_settings() != self.default_config().learning_settings():
            return None
        attrs = {"default": True, "run": self.run_name, "reused_from": e.source,
                 "epochs_run": len(e.val_curve),
                 "wall_s": e.wall_s, "samples_per_s": e.samples_per_s}
        if len(e.epoch_end_at) == len(e.val_curve):
            attrs["epoch_end_at"] = list(e.epoch_end_at)
        if e.weights is not None and e.weights.exists():
            attrs["weights"] = str(e.weights)
        return optuna.trial.create_trial(
            params=self.default_params(), distributions=self.distributions(),
            value=max(0.0, max(e.val_curve)), user_attrs=attrs,
            system_attrs=self._rungs_passed(e.val_curve),
            intermediate_values={epoch: acc for epoch, acc in enumerate(e.val_curve, start=1)})

    def _rungs_passed(self, curve: list[float]) -> dict[str, float]:
        """The successive halving rungs a trial of `curve` would have recorded had it trained
        here (Optuna's completed_rung_<k>: its value at epoch first_rung * 3^k, asked at every
        epoch but the last): a trial added whole is never asked, and without them the others
        at a rung were not compared with the default. Hyperband has one bracket here (its
        first rung is two thirds of the epochs), whose rungs are successive halving's."""
        if self.pruner not in ("asha", "hyperband"):
            return {}
        rungs, k, epoch = {}, 0, self.first_rung()
        while epoch < min(self.epochs, len(curve) + 1):
            rungs[f"completed_rung_{k}"] = curve[epoch - 1]
            k, epoch = k + 1, epoch * REDUCTION_FACTOR
        return rungs

    def objective(self, trial) -> float:
        """Train one candidate; return its best validation accuracy. A trial stopped by Ctrl-C
        anywhere in it (its training, or keeping its weights after: seconds on Drive) is
        queued again."""
        try:
            return self._objective(trial)
        except KeyboardInterrupt:
            self._retry_interrupted(trial)
            raise

    def _objective(self, trial) -> float:
        config = dataclasses.replace(self.suggest(trial), progress=False)
        trial.set_user_attr("run", self.run_name)  # whose trial, over its sessions
        batch = trial.params.get("batch_size")
        if batch in self.unjudged and not trial.user_attrs.get("default"):
            # drawn from a study that still has it (Optuna keeps a study's choices): stopped
            # before it trains (and before the other ranks under torchrun are told of it), as
            # it could never be judged against the default trial; it is not counted as a trial
            reason = (f"batch {batch} not trained: its first epoch alone takes more optimizer "
                      "steps than the default trial's epochs")
            trial.set_user_attr("pruned_reason", reason)
            trial.set_user_attr("untrained", True)
            raise optuna.TrialPruned(reason)
        distributed.from_main(config)  # under torchrun: the other ranks train it too
        # With --local-dir the output dir's copy of the study is refreshed only between trials:
        # a session lost mid-trial (a new Colab VM) left no RUNNING trial there to retry.
        self._copy_to_mirror()

        ended: list[float] = []
        curve: dict[int, float] = {}

        def on_epoch(epoch: int, metrics: dict[str, float]) -> None:
            ended.append(time.time())
            curve[epoch] = metrics["val_acc"]
            trial.report(metrics["val_acc"], epoch)
            if distributed.from_main(trial.should_prune()):
                trial.set_user_attr("pruned_reason", f"pruned after epoch {epoch}")
                raise optuna.TrialPruned(f"pruned after epoch {epoch}")

        try:
            result = fit(self.index, config, on_epoch=on_epoch)
        except (DivergedError, RuntimeError) as exc:  # torch's OutOfMemoryError: a RuntimeError
            failed = trial_failure(exc)
            if failed is None:
                if isinstance(exc, UserError):
                    exc.amid_trial = True  # see below
                raise
            if failed == "diverged":
                trial.set_user_attr("pruned_reason", str(exc))
                raise optuna.TrialPruned(str(exc)) from None
            result = None
        except UserError as exc:  # an image unreadable mid-trial: the other ranks are in this
            exc.amid_trial = True  # trial's collectives, not where rank 0 could tell them
            raise
        if result is None:
            # Outside the except block, whose traceback holds the trial's model: so the next
            # trial starts with the memory back.
            release(resolve_device(config.device))
            reason = f"out of memory at batch_size={config.batch_size}"
            trial.set_user_attr("pruned_reason", reason)
            raise optuna.TrialPruned(reason)
        rate = result.timing.get("samples_per_s")  # None when no step was timed
        trial.set_user_attr("samples_per_s", None if rate is None else float(rate))
        trial.set_user_attr("epochs_run", result.epochs_run)
        trial.set_user_attr("wall_s", result.wall_s)
        trial.set_user_attr("epoch_end_at", ended)
        trial.set_user_attr("worker", self.worker)
        try:
            self._keep_weights(trial, result, curve)
        except UserError:  # not written (a full disk): the rerun the error advises trains it
            self._retry_interrupted(trial)
            raise
        return result.best_val_acc

    def _retry_interrupted(self, trial) -> None:
        """A trial stopped by Ctrl-C (Colab's Stop), or whose weights could not be kept, is
        FAIL, as Optuna marks it: queued again with its parameters, so --resume trains it, as
        it does one cut off by a lost session (_retry_cut_off). The default trial is queued
        again by run() already."""
        if trial.user_attrs.get("default"):
            return
        try:  # run() copies the study to the mirror once Optuna has marked this one FAIL
            trial.study.enqueue_trial(trial.params, user_attrs={"retried_from": trial.number})
        except Exception as exc:  # the storage unreachable too: --resume then draws anew
            log.warning("trial %d was stopped and could not be queued again (%s)", trial.number,
                        first_line(exc))

    def _keep_weights(self, trial, result, curve: dict[int, float]) -> None:
        """Keep the weights of the default trial and of the trial choice() would rank first so
        far: the final run trains one of the two configurations, and continues from its trial
        (weights_for)."""
        if self.weights_dir is None:
            return
        default = bool(trial.user_attrs.get("default"))
        complete = self._complete()  # one read of the study
        default_trial = next((t for t in complete if t.user_attrs.get("default")), None)
        if not default:
            mine = result.best_val_acc if default_trial is None else \
                self._judged(trial.params["batch_size"], curve, result.best_val_acc)
            ranks = [r for r in (self._rank(t, default_trial) for t in complete) if r is not None]
            if mine is None or (ranks and mine <= max(ranks)):
                return
        path = save_weights(result.model,
                            self.weights_dir / f"hpo-trial-{trial.number}.weights.pt")
        trial.set_user_attr("weights", str(path))
        # The best before this one cannot be chosen any more; while the default has no result
        # (another worker training it), the ranking may still change: nothing is deleted.
        if not default and (default_trial is not None or self._failed_default() is not None):
            # Only files in this run's folder: on a shared study, another worker's trial's
            # weights are that worker's, which may be continuing from them.
            mine_dir = self.weights_dir.resolve()
            for t in complete:
                kept = kept_file(t.user_attrs.get("weights"), self.weights_dir)
                if kept and not t.user_attrs.get("default") and kept.resolve().parent == mine_dir:
                    kept.unlink(missing_ok=True)

    def weights_for(self, params: dict | None) -> tuple[Path | None, int]:
        """(the weights the completed trial of `params` ended with (None: the default trial's),
        its epochs), or (None, 0) when none were kept here."""
        trial = self._trial_for(params)
        path = kept_file(trial.user_attrs.get("weights"), self.weights_dir) \
            if trial is not None else None
        if path is None:
            return None, 0
        return path, int(trial.user_attrs.get("epochs_run") or self.epochs)

    def _trial_for(self, params: dict | None) -> optuna.trial.FrozenTrial | None:
        """The completed trial of `params` (None: the default trial), or None."""
        return self._default_trial() if params is None else \
            next((t for t in self._complete() if t.params == params), None)

    def start_for(self, params: dict | None) -> tuple[Path | None, int, str]:
        """Where the final run of `params` (None: the default configuration) starts: weights,
        the epochs they trained, and which trial they are from. The default configuration
        continues from the earlier trial instead of its own when that trained what it learns
        (TrainConfig.learning_settings: the autotuner may pick other speed knobs at another
        size) at the final run's size, and either the trials trained at a smaller one (the
        earlier trial is the same start at the size the final run trains) or it trained for
        more epochs and reached at least the default trial's validation accuracy: the final run
        continues from the most-trained weights of what it trains."""
        if params is not None:
            return (*self.weights_for(params), "the chosen trial")
        weights, epochs = self.weights_for(None)
        e, default = self.earlier, self._default_trial()
        final = {**self.default_config().learning_settings(), "image_size": self.final_size}
        if e is None or e.weights is None or not e.weights.exists() or \
                {**e.config.learning_settings(), "epochs": self.epochs} != final:
            return weights, epochs, "the default trial"
        at_final_size = self.final_size != self.base.image_size and len(e.val_curve) >= epochs
        longer = len(e.val_curve) > epochs and \
            (default is None or max(e.val_curve, default=0.0) >= (default.value or 0.0))
        if at_final_size or longer:
            return e.weights, len(e.val_curve), e.source
        return weights, epochs, "the default trial"

    def curve_for(self, params: dict | None) -> list[tuple[float, float]]:
        """(time.time() at its end, validation accuracy) for each epoch of the trial the final
        run of `params` continues from (start_for), when this run trained it (in this session
        or an earlier one) or it is the earlier trial this run reused as its default (whose
        seconds the scenario counts); none for another worker's on a shared study, whose time
        was spent elsewhere."""
        _, _, source = self.start_for(params)
        trial = None if source not in ("the chosen trial", "the default trial") else \
            self._trial_for(params)
        # This run's trial, trained in an earlier session of it (a resume after Stop) too, or
        # reused as its default: its worker names only the session that trained it.
        ours = trial is not None and trial.user_attrs.get("run") == self.run_name
        if trial is None or (trial.user_attrs.get("worker") != self.worker and not ours):
            return []
        values = [trial.intermediate_values[e] for e in sorted(trial.intermediate_values)]
        return list(zip(trial.user_attrs.get("epoch_end_at") or [], values))

    # ------------------------------------------------------------------------- the study

    def _storage(self) -> optuna.storages.RDBStorage:
        keyword = "heartbeat_stale_trial_callback" if hasattr(
            optuna.storages, "RetryHeartbeatStaleTrialCallback") else "failed_trial_callback"
        try:
            with warnings.catch_warnings():  # heartbeats and retries are flagged experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry = retry_callback()
                # SQLite's own wait for another process's lock is 5 s: workers sharing a file
                # (and a heartbeat thread each) wait longer before a write fails.
                engine = {"connect_args": {"timeout": modules.storage.SQLITE_WAIT_S}} \
                    if self.storage_url.startswith("sqlite") else None
                return opened(lambda: Storage(self.storage_url, engine_kwargs=engine,
                                              heartbeat_interval=modules.storage.HEARTBEAT_S,
                                              grace_period=modules.storage.GRACE_S,
                                              **{keyword: retry}))
        except Exception as exc:  # SQLAlchemy raises many types for bad URLs / unreachable DBs
            raise storage_error(self.storage_url, exc) from None

    def chance(self) -> float:
        """What a trial that has learned nothing validates at (chance_level)."""
        return validation_chance(self.index)

    def first_rung(self) -> int:
        """The epoch at which successive halving first compares trials."""
        return first_rung(self.epochs)

    @staticmethod
    def shortest_trial(pruner: str, epochs: int) -> int:
        """The fewest epochs a trial of `epochs` trains before `pruner` can stop it."""
        if pruner == "none":
            return epochs
        if pruner == "median":  # it judges from the epoch after its warm-up
            return min(epochs, MEDIAN_WARMUP + 1)
        return 1  # a trial clear of chance after its first epoch (early_rungs; or first_rung 1)

    def _make_pruner(self) -> optuna.pruners.BasePruner:
        if self.pruner == "median":
            # Optuna judges from the step equal to n_warmup_steps; epochs are reported from 1.
            pruner = optuna.pruners.MedianPruner(n_startup_trials=2,
                                                 n_warmup_steps=MEDIAN_WARMUP + 1)
        elif self.pruner == "none":
            return optuna.pruners.NopPruner()
        elif self.pruner == "hyperband":
            pruner = optuna.pruners.HyperbandPruner(min_resource=self.first_rung(),
                                                    max_resource=self.epochs,
                                                    reduction_factor=REDUCTION_FACTOR)
        else:
            pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=self.first_rung(),
                                                            reduction_factor=REDUCTION_FACTOR)
        return _BeyondNoise(pruner, len(self.index.val), self.chance(), self.epochs,
                            () if self.pruner == "median" else early_rungs(self.epochs))

    def _log_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        value = "-" if trial.value is None else f"{trial.value:.4f}"
        reason = trial.user_attrs.get("pruned_reason")
        log.info("trial %d %s value %s params %s%s", trial.number, trial.state.name, value,
                 self.trained(trial), f" ({reason})" if reason else "")

    def trained(self, trial: optuna.trial.FrozenTrial) -> dict:
        """The hyperparameters `trial` trained: the default trial trains the base's own values,
        where the study records them clamped into the searched ranges (default_params)."""
        if trial.user_attrs.get("default"):
            return self.searched(self.default_config())
        return dict(trial.params)

    def run(self, *, ended: bool = False) -> dict:
        """Optimise until the study has n_trials finished trials (on a shared --storage: run
        n_trials of this worker's), so that a resumed search runs only what it lacks; return a
        summary of the whole study (earlier sessions included). ended=True (with resume): the
        study's search has ended (its final run started): trials run only when it has fewer
        finished trials than n_trials (a --n-trials above the count it was asked for grows
        it; a growth cut short is finished); on a shared study only when n_trials is more than
        it was asked for."""
        # We log one line per trial; Optuna's own warning for a failed trial carries the whole
        # traceback of a Ctrl-C, which the command line answers in one line. The caller's
        # level comes back after: a library caller's other studies keep theirs.
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        try:
            return self._run(ended=ended)
        except Exception as exc:
            cause = None if isinstance(exc, UserError) else storage_cause(exc)
            if cause is None:
                raise
            # A database locked past its wait (another process holding SQLite's lock), a
            # server gone: the trials recorded stay, and a trial cut off is retried.
            raise UserError(
                f"the study's storage {without_password(self.storage_url)!r} failed "
                f"({type(cause).__name__}: {scrub(first_line(cause), self.storage_url)}); "
                "the finished trials are kept: rerun with --resume to continue.") from None
        finally:
            optuna.logging.set_verbosity(verbosity)

    def _run(self, *, ended: bool) -> dict:
        storage, where = self.storage, without_password(self.storage_url)
        shared = self.shared
        exists = self.study_name in optuna.get_all_study_names(storage)
        # A study is deleted only when asked (overwrite=True), and never on a shared database,
        # where another worker's trials would go with it: there every worker joins.
        if self.overwrite and shared:
            raise UserError(f"refusing to delete the shared study {self.study_name!r} in {where}.")
        if exists and shared:
            log.info("joining the shared study %r in %s", self.study_name, where)
        elif exists and self.overwrite:
            log.info("deleting the study %r in %s (overwrite=True)", self.study_name, where)
            optuna.delete_study(study_name=self.study_name, storage=storage)
        elif exists and not self.resume:
            raise UserError(f"study {self.study_name!r} already exists in {where}: resume it "
                            "(--resume; resume=True from Python), or give the new one another "
                            "name; nothing was deleted.")
        # constant_liar: parallel workers see each other's running trials as poor results, so
        # they do not all sample the same point.
        try:  # which worker created the study: on a shared one, that worker queues the default
            self.study = optuna.create_study(
                storage=storage, study_name=self.study_name, direction="maximize",
                pruner=self._make_pruner(), load_if_exists=False)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            self.study = optuna.create_study(
                storage=storage, study_name=self.study_name, direction="maximize",
                pruner=self._make_pruner(), load_if_exists=True)
            created = False
        # Seeded by the trials already there: a resumed study's sampler in a new process would
        # otherwise draw its first (random) points again, repeating trials already run. On a
        # shared study the two are mixed, not added: worker 3 joining at 6 trials would draw
        # what worker 5 joining at 4 drew.
        n = len(self.study.trials)
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{n}".encode()).digest()[:4], "little") \
            if shared else (self.seed + n) % 2**32
        self.study.sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        data = self.study.user_attrs.get("data_fingerprint")
        if self.data_fingerprint and data and data != self.data_fingerprint and \
                not self.index.same_data(data):  # an older version's form of the same data
            raise UserError(f"study {self.study_name!r} in {where} searched other data (its "
                            f"images differ from this run's): give this run its own study.")
        if self.data_fingerprint and not data:
            self.study.set_user_attr("data_fingerprint", self.data_fingerprint)
        self._check_trial_setup(where)
        self._keep_study_batch_sizes()
        finished_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        # On a shared study this run counts its own trials (every worker runs n_trials), over
        # its sessions; a study of its own, all of them.
        count_key = f"n_trials:{self.run_name}" if shared else "n_trials"
        given_key = f"{count_key}:given"  # the last --n-trials the user gave, not a preset

        def mine(trial: optuna.trial.FrozenTrial) -> bool:
            return not shared or trial.user_attrs.get("run") == self.run_name

        def done() -> int:
            return sum(t.state in finished_states and mine(t) and _trained(t)
                       for t in self.study.trials)
        # Resumed without a count of its own: the count it was asked for, not a preset.
        n_trials = self.study.user_attrs[count_key] if self.resume and self.study_count and \
            count_key in self.study.user_attrs else self.n_trials
        budget_key = f"time_budget_s:{count_key}"
        if self.resume and self.study_count and self.auto_budget and \
                budget_key in self.study.user_attrs:  # and the budget it was started with
            self.timeout_s = self.study.user_attrs[budget_key]
        if ended and self.resume and self.study.trials:
            # Its search ended (by its count or its time budget) when the final run started:
            # only an explicit --n-trials above the last one given (none given: above the
            # trials run) grows it, so that the same command resumed again adds nothing; a
            # growth cut short is finished by the next resume, which otherwise adds nothing.
            grown_key, _ = self._growth_keys()
            attrs = self.study.user_attrs
            pending = attrs.get(grown_key) if attrs.get(grown_key, 0) > done() else None
            asked = attrs.get(given_key, done())
            more = self.n_trials if not self.study_count and self.n_trials > asked else None
            n_trials = max((n for n in (pending, more) if n is not None), default=None)
            if n_trials is None:
                log.info("study %r: its %d trials as they are, none added", self.study_name,
                         len(self.study.trials))
                # the budget its search ran under, which this session (its final run begun)
                # was not given
                self.timeout_s = self.study.user_attrs.get(budget_key, self.timeout_s)
                return self.summary()
            self.study.set_user_attr(grown_key, n_trials)
        if self.sole_user and not shared:
            self._retry_cut_off()
        reused = 0
        # A default trial stopped by Ctrl-C is FAIL, and queued again; a pruned one (it
        # diverged, ran out of memory, fell behind) stands.
        alive = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                 optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING)
        # Workers starting together on a new shared study each found no default trial: only
        # its creator queues it (a joiner does once the study has trials and still none).
        creators_turn = created or not shared or bool(self.study.trials)
        if creators_turn and not any(t.user_attrs.get("default") and t.state in alive
                                     for t in self.study.trials):
            # The default configuration is always a candidate, so the search can only keep or
            # beat it (see choice()).
            default = self._reused_default()
            if default is not None:
                self.study.add_trial(default)
                self._copy_to_mirror()
                reused = 1
                log.info("trial 0 (the default configuration) is %s: the same learning "
                         "settings for the same %d epochs, not trained again; value %.4f",
                         self.earlier.source, self.epochs, default.value)
            else:
                self.study.enqueue_trial(self.default_params(), user_attrs={"default": True})
        def waiting() -> int:  # queued: the default, a stopped trial's retry
            return len(self.study.get_trials(deepcopy=False,
                                             states=(optuna.trial.TrialState.WAITING,)))
        before, waiting_before, untrained_before = len(self.study.trials), waiting(), \
            self._untrained()
        drawn_out = False  # the redraws of trials not trained ran out
        have = done()  # a reused default trial among them
        to_run = n_trials - have
        self.study.set_user_attr(count_key, n_trials)
        self.study.set_user_attr(budget_key, self.timeout_s)
        if not self.study_count:
            self.study.set_user_attr(given_key, self.n_trials)
        if self.resume and have > reused:
            log.info("study %r: %d of %s %d trials done, %d to run", self.study_name, have,
                     "this run's" if shared else "its", n_trials, max(0, to_run))
        finished = lambda: sum(t.state.is_finished() and _trained(t)  # noqa: E731
                               for t in self.study.trials)
        finished_before = finished()
        left = self.time_left()
        if to_run > 0 and left is not None and left <= 0:
            log.info("study %r: its time budget (%.0f s) was spent by the trials already run: "
                     "none added", self.study_name, self.timeout_s)
        elif to_run > 0:
            try:
                # Its own study's budget counts the trials' seconds (time_left), as a resumed
                # session does: Optuna's timeout counted the gaps between trials too, and a
                # search it ended found time left when resumed, and ran more trials.
                own = not self.shared and left is not None
                asked, draws = to_run, 0
                ends = None if left is None else time.monotonic() + left  # Optuna's timeout
                while asked > 0 and draws < 3 * to_run:  # bounded: a sampler drawing on
                    untrained = self._untrained()
                    self.study.optimize(self.objective, n_trials=asked, timeout=None if own or
                                        ends is None else max(0.0, ends - time.monotonic()),
                                        callbacks=[self._log_trial, self._copy_to_mirror,
                                                   *([self._stop_when_spent] if own else [])],
                                        gc_after_trial=True)
                    draws += asked
                    # the trials not trained (a batch the search leaves out) are drawn again
                    asked = self._untrained() - untrained
                    if (own and self.time_left() <= 0) or \
                            (not own and ends is not None and time.monotonic() >= ends):
                        break
                drawn_out = asked > 0 and draws >= 3 * to_run
            except KeyboardInterrupt:  # the stopped trial FAIL, its retry queued: in the copy
                self._copy_to_mirror()
                raise
        if shared:
            self._await_default()
        # trained ones: one drawn at a batch the search leaves out is not
        self.new_trials = len(self.study.trials) - before + waiting_before - waiting() \
            - (self._untrained() - untrained_before)
        ran = finished() - finished_before
        if drawn_out:
            log.info("study %r: %d of the %d trials asked for trained; the others were drawn "
                     "at batch sizes this search leaves out, %d times in all", self.study_name,
                     ran, to_run, self._untrained() - untrained_before)
        elif self.timeout_s is not None and 0 < ran < to_run:
            log.info("study %r: the time budget (%.0f s) ended the search after %d of the %d "
                     "trials asked for", self.study_name, self.timeout_s, ran, to_run)
        return self.summary()

    def _retry_cut_off(self) -> None:
        """A study no other process uses (sole_user): a trial still RUNNING was cut off with
        the last session (a killed kernel, a lost Colab VM). It is failed and queued again
        with its parameters and attributes at once, as the heartbeat's retry would after its
        grace period, which a short resumed search can end before."""
        storage = getattr(self.study._storage, "_backend", self.study._storage)  # Optuna's cache
        cut_off = [t.number for t in self.study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))]
        if not cut_off or not isinstance(storage, Storage):
            return
        storage.all_stale = True
        try:
            with warnings.catch_warnings():  # flagged experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(self.study)
        finally:
            storage.all_stale = False
        log.info("trial(s) %s cut off with the last session: trained again with the same "
                 "parameters", ", ".join(map(str, cut_off)))

    def _growth_keys(self) -> tuple[str, str]:
        """The study's attributes for a growth after the final run started: the count it grew
        to, and the count the final run was last decided for."""
        suffix = f":{self.run_name}" if self.shared else ""
        return f"grown_to{suffix}", f"final_for{suffix}"

    def growth_pending(self) -> bool:
        """Whether the study grew after its final run started, and the final run was not
        decided again since (the session that grew it was cut short)."""
        grown, final = self._growth_keys()
        attrs = self._require_study().user_attrs
        return grown in attrs and attrs.get(final) != attrs[grown]

    def growth_settled(self) -> None:
        """The final run was decided for the study as it is now."""
        grown, final = self._growth_keys()
        attrs = self._require_study().user_attrs
        if grown in attrs:
            self.study.set_user_attr(final, attrs[grown])

    def search_seconds(self) -> float:
        """Seconds the study's completed and pruned trials trained, over every session. Not
        counted: a default trial taken from another scenario (it trained there), and failed
        trials, whose end a lost session's heartbeat records only when the next one starts."""
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        return sum((t.datetime_complete - t.datetime_start).total_seconds()
                   for t in self._require_study().trials
                   if t.state in done and t.datetime_start and t.datetime_complete
                   and not t.user_attrs.get("reused_from"))

    def time_left(self) -> float | None:
        """What is left of timeout_s, the search's time in all: a resumed search spends what
        its earlier sessions left. On a shared study each worker's budget is its own session's,
        since the study's trials are every worker's."""
        if self.timeout_s is None or self.shared:
            return self.timeout_s
        return self.timeout_s - self.search_seconds()

    def _untrained(self) -> int:
        """This worker's trials drawn at a batch the search leaves out, not trained."""
        return sum(not _trained(t) and t.user_attrs.get("run") in (None, self.run_name)
                   for t in self.study.trials)

    def _stop_when_spent(self, study, trial) -> None:
        if self.time_left() <= 0:
            study.stop()

    def _copy_to_mirror(self, study=None, trial=None) -> None:
        if self.mirror is not None:
            copy_sqlite(*self.mirror)

    def summary(self) -> dict:
        study = self._require_study()
        states = [t.state for t in study.trials if _trained(t)]
        complete = states.count(optuna.trial.TrialState.COMPLETE)
        default = self._default_trial()
        best_value = study.best_value if complete else None
        n_val = len(self.index.val)
        params, reason = self.choice()
        return {"best_params": self.trained(study.best_trial) if complete else {},
                "best_value": best_value,
                "best_value_se": None if best_value is None else accuracy_se(best_value, n_val),
                "default_value": default.value if default else None,
                "default_reused_from": default.user_attrs.get("reused_from") if default else None,
                # its seconds: the scenario counts them as tuning, as if trained here
                "default_reused_s": default.user_attrs.get("wall_s")
                if default and default.user_attrs.get("reused_from") else None,
                "n_val": n_val, "trial_epochs": self.epochs,
                "chosen_params": params, "keeps_default": params is None, "choice": reason,
                "chosen_epoch_s": self.final_epoch_seconds(params),
                "trial_size": self.base.image_size,
                # trials that ran to their end or were stopped; a trial cut off with its
                # session is FAIL, and its retry is another trial of the same parameters
                "n_trials": complete + states.count(optuna.trial.TrialState.PRUNED),
                "n_pruned": states.count(optuna.trial.TrialState.PRUNED),
                "n_failed": states.count(optuna.trial.TrialState.FAIL), "n_complete": complete,
                "time_budget_s": self.timeout_s,
                "search_s": round(self.search_seconds(), 1), "study_name": self.study_name,
                "storage": without_password(self.storage_url)}

    def _keep_study_batch_sizes(self) -> None:
        """Optuna refuses a categorical whose choices change within a study, mid-trial. The
        memory bound is measured on each run's GPU: a study resumed on another GPU (Colab
        hands out a T4, an L4 or an A100), or joined from one, keeps the batch sizes it
        searched (one that does not fit is split into smaller passes, or its trial recorded as
        out of memory). Batch sizes outside this search's are refused, said now."""
        old = next((t.distributions["batch_size"] for t in self.study.trials
                    if "batch_size" in t.distributions), None)
        if old is None or tuple(old.choices) == self.batch_sizes:
            return
        if not set(old.choices) <= set(self.searchable_batch_sizes):
            raise UserError(f"cannot resume study {self.study_name!r}: its batch sizes were "
                            f"{tuple(old.choices)}, now {self.batch_sizes} (keep batch_sizes, or "
                            "run without resume to start over).")
        log.info("study %r searched batch sizes %s: kept (this search's own would be %s)",
                 self.study_name, tuple(old.choices), self.batch_sizes)
        self.batch_sizes = tuple(old.choices)

    def _check_trial_setup(self, where: str) -> None:
        """A study's trials are compared with each other, so they all train at one size for
        the same epochs, the same model from the same start, with the settings the search
        leaves alone: a resumed or joined study whose trials trained otherwise (another picked
        size, other --epochs, another --model or --weights, a version that gave trials other
        epochs at that size ...) is refused, and a new one records its own. A study recorded
        before a setting was is checked on those it has."""
        b = self.base
        weights = b.weights if b.weights in ("imagenet", "none") else \
            f"file {Path(b.weights).name}"  # a path differs between workers' machines
        setup = {"image_size": b.image_size, "epochs": self.epochs, "model": b.model,
                 "weights": weights, "momentum": b.momentum, "scheduler": b.scheduler,
                 "warmup_epochs": b.warmup_epochs, "max_grad_norm": b.max_grad_norm,
                 # The default trial, which any worker may train, is the study's record of
                 # these; the batch is left out: it may be what fits one worker's GPU.
                 "default_lr": b.lr, "default_optimizer": b.optimizer,
                 "default_weight_decay": b.weight_decay,
                 # a searched batch is a micro-batch: with other accumulation its trials took
                 # other effective batches and optimizer steps, judged by one ratio (choice)
                 "grad_accum_steps": b.grad_accum_steps,
                 # torchrun's processes each train the searched batch: a trial's global batch
                 # (and steps per epoch) is that many times it
                 "processes": distributed.world_size()}
        saved = recorded = self.study.user_attrs.get("trial_setup")
        if saved is None:  # a study from before the record: its finished trials' epochs
            ran = {t.user_attrs.get("epochs_run") for t in self._complete()} - {None}
            if ran and ran != {self.epochs}:
                recorded = {"epochs": sorted(ran)[0]}
        differ = [k for k, v in (recorded or {}).items() if setup.get(k) != v]
        if differ == ["image_size"] and self.keep_study_size:
            log.info("study %r: its trials trained at %d px: the rest train there too, not at "
                     "%d px (--search-size N chooses)", self.study_name, recorded["image_size"],
                     self.base.image_size)
            self.base = dataclasses.replace(self.base, image_size=recorded["image_size"])
            return
        if differ:
            raise UserError(
                f"cannot resume study {self.study_name!r} in {where}: its trials trained "
                + ", ".join(f"{k}={recorded[k]}" for k in differ) + ", this run's would train "
                + ", ".join(f"{k}={setup[k]}" for k in differ) + " (resume with the settings "
                "it started with" + (f", --search-size {recorded['image_size']} for its size"
                                     if "image_size" in differ else "")
                + ", or give this run its own study; nothing was deleted).")
        if saved is None:
            self.study.set_user_attr("trial_setup", setup)

    def _complete(self) -> list[optuna.trial.FrozenTrial]:
        return [t for t in self._require_study().trials
                if t.state == optuna.trial.TrialState.COMPLETE]

    def _default_trial(self) -> optuna.trial.FrozenTrial | None:
        """The completed trial of the default configuration, if any."""
        return next((t for t in self._complete() if t.user_attrs.get("default")), None)

    def _await_default(self) -> None:
        """On a shared study, the default configuration's trial that another worker is still
        training is waited for: choice() would otherwise find no default to compare the
        search with, and keep it untrained, whatever this worker's trials reached. A trial
        whose worker has gone silent (no heartbeat for GRACE_S, a killed worker) is failed,
        which queues it again, and trained here: left RUNNING, it was retried only when some
        worker next started a trial, which a worker restarted within the grace period had
        done already."""
        said = False
        while self._default_trial() is None:
            pending = self._running_default()
            if pending is not None and pending._trial_id in self.storage._get_stale_trial_ids(
                    self.study._study_id):
                with warnings.catch_warnings():  # flagged experimental
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    optuna.storages.fail_stale_trials(self.study)  # its retry queued
                pending = self._running_default()  # another worker's retry of it, if any
            if pending is None:
                if not any(t.user_attrs.get("default") for t in self.study.get_trials(
                        deepcopy=False, states=(optuna.trial.TrialState.WAITING,))):
                    return
                log.info("study %r: the default configuration's trial was cut off with its "
                         "worker: training it here, as the search is judged against it",
                         self.study_name)
                self.study.optimize(self.objective, n_trials=1,
                                    callbacks=[self._log_trial, self._copy_to_mirror],
                                    gc_after_trial=True)
                continue
            if not said:
                log.info("study %r: waiting for trial %d, the default configuration, which "
                         "another worker is training: the search is judged against it",
                         self.study_name, pending.number)
                said = True
            time.sleep(modules.storage.HEARTBEAT_S)

    def _running_default(self) -> optuna.trial.FrozenTrial | None:
        """The default configuration's trial, RUNNING (on a shared study, maybe elsewhere)."""
        return next((t for t in self.study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            if t.user_attrs.get("default")), None)

    def _failed_default(self) -> str | None:
        """Why the default configuration's trial ended without a result (it diverged, ran out
        of memory: the pruner never stops it for falling behind), or None."""
        trials = [t for t in self._require_study().trials if t.user_attrs.get("default")
                  and t.state == optuna.trial.TrialState.PRUNED]
        if not trials:
            return None
        reason = str(trials[-1].user_attrs.get("pruned_reason") or "pruned").strip()
        return reason.splitlines()[0].split(";")[0][:160] if reason else "pruned"  # not its hint

    def epoch_seconds(self, params: dict | None) -> float | None:
        """Seconds per epoch (validation included) measured by the trial of `params` (None:
        the default trial), or None when no such trial recorded it."""
        trial = self._trial_for(params)
        if trial is None:
            return None
        epochs, wall = trial.user_attrs.get("epochs_run"), trial.user_attrs.get("wall_s")
        return wall / epochs if epochs and wall else None

    def final_epoch_seconds(self, params: dict | None) -> float | None:
        """epoch_seconds(params) at the final run's size: scaled by what the earlier trial (the
        default configuration at that size) took per epoch against the default trial here,
        else by the ratio of pixels, when the trials trained at a smaller size."""
        seconds = self.epoch_seconds(params)
        if seconds is None or self.final_size == self.base.image_size:
            return seconds
        e, here = self.earlier, self.epoch_seconds(None)
        if e is not None and e.config.image_size == self.final_size and e.val_curve and \
                e.wall_s and here:
            return seconds * (e.wall_s / len(e.val_curve)) / here
        return seconds * (self.final_size / self.base.image_size) ** 2

    def choice(self) -> tuple[dict | None, str]:
        """(the parameters the final run should train, why); None keeps the default
        configuration: the search's best must have left chance and beat the default trial on
        validation by more than one standard error of the difference, within no more epochs
        and no more optimizer steps than the default trial took (within_default_steps). A
        default whose trial diverged or ran out of memory gives way to the best completed
        trial, left chance or not: its own final run would fail the same way."""
        complete = self._complete()
        if not complete:
            failed = self._failed_default()
            return None, ("no trial completed: keeping the default configuration" + (
                "" if failed is None else f", whose trial failed ({failed}): its final run "
                "may fail the same way"))
        default = self._default_trial()
        # A trial whose first epoch alone took more optimizer steps than the default's whole
        # trial cannot be judged within them: it does not compete (batch 16 beside 64, over
        # 3-epoch trials).
        judged = [t for t in complete if self._rank(t, default) is not None]
        top = max(judged, key=lambda t: t.value)
        # The search's best is ranked within the default's optimizer steps: ranked by their
        # last epoch, the smaller batches lead by their extra steps, and a trial ahead at equal
        # steps went unseen.
        rivals = [t for t in judged if default is None or t.number != default.number]
        best = max(rivals or judged, key=lambda t: self._rank(t, default))
        n = len(self.index.val)
        if default is None:
            failed = self._failed_default()
            if failed is not None:  # its final run would fail the same way, and end the run
                return dict(best.params), (
                    f"the default configuration's trial failed ({failed}): training the "
                    f"search's best instead (trial {best.number}, {100 * best.value:.1f}%)")
            return None, ("the default configuration has no completed trial to compare with: "
                          "keeping it")
        # Every trial trains the same epochs at the same size, so one that has left chance
        # where the default has not is ahead at equal cost, and the final run continues from it.
        chance = self.chance()
        if not informative(top.value, n, chance):
            return None, (f"no trial has left {chance_words(chance)} after "
                          f"{self.epochs} epochs (best {100 * top.value:.1f}%): the trials are "
                          "too short to rank configurations; keeping the default")
        value, last = self.within_default_steps(best, default)
        margin = (f"by more than {100 * tie_margin(value, default.value, n):.1f} points on "
                  f"{n} validation images")
        shown = f"trial {best.number}, {100 * best.value:.1f}%" + (
            "" if last == self.epochs else
            f", {100 * value:.1f}% after epoch {last}, within the default trial's optimizer steps")
        if not rivals:
            return None, ("no trial but the default's completed within its optimizer steps, "
                          f"to compare with it ({100 * default.value:.1f}%): keeping the default")
        if not beats(value, default.value, n):
            return None, (f"the search's best ({shown}) does not beat the default "
                          f"({100 * default.value:.1f}%) {margin}: keeping the default")
        if not informative(best.value, n, chance):
            return None, (f"the search's best ({shown}) has not left {chance_words(chance)}: "
                          "keeping the default")
        return dict(best.params), (f"the search's best ({shown}) beats the default "
                                   f"({100 * default.value:.1f}%) {margin}")

    def within_default_steps(self, trial: optuna.trial.FrozenTrial,
                             default: optuna.trial.FrozenTrial) -> tuple[float, int]:
        """(`trial`'s best validation accuracy up to the last epoch by which it had taken no
        more optimizer steps than the default trial's epochs took, that epoch; epoch 0 when its
        first epoch took more than those, and it cannot be judged within them). A smaller batch
        takes more steps per epoch, and in trials this short a lead at equal epochs is mostly
        those extra steps: the search's batch-16 winners led the default after 4 epochs and
        ended below it (docs/tuning.md)."""
        if trial.number == default.number:  # its recorded batch is the nearest choice's
            return trial.value, self.epochs
        return self._judged_at(trial.params["batch_size"], trial.intermediate_values,
                               trial.value)

    def _judged_at(self, batch_size: int, curve: dict[int, float], value: float
                   ) -> tuple[float, int]:
        """within_default_steps for a trial of `batch_size`, validation `curve` (by epoch) and
        best value."""
        last = self._judged_epochs(batch_size)
        if last < 1:  # its first epoch took more steps than the default trial's epochs
            return value, 0
        values = [v for epoch, v in curve.items() if epoch <= last]
        return (max(values) if values and last < self.epochs else value), last

    def _judged_epochs(self, batch_size: int) -> int:
        """The most epochs of a trial at `batch_size` within the default trial's optimizer
        steps, STEP_SLACK over them included (0: its first epoch alone takes more), counted as
        the trainer takes them: each process's share, grad_accum_steps batches a step."""
        def steps(batch: int) -> int:
            return steps_per_epoch(dataclasses.replace(self.base, batch_size=batch), self.n_train)
        allowed = self.epochs * steps(self.base.batch_size) * (1 + STEP_SLACK)
        return min(self.epochs, int(allowed / steps(batch_size) + 1e-9))

    def _judged(self, batch_size: int, curve: dict[int, float], value: float) -> float | None:
        """What choice() ranks a trial by, against a completed default trial; None when it
        cannot be judged within the default's steps, and does not compete."""
        judged, last = self._judged_at(batch_size, curve, value)
        return judged if last > 0 else None

    def _rank(self, trial: optuna.trial.FrozenTrial,
              default: optuna.trial.FrozenTrial | None) -> float | None:
        """choice()'s ranking of a completed trial: its value within the default trial's
        optimizer steps (its whole value when there is no default to judge by); None: it does
        not compete."""
        if default is None or trial.number == default.number:
            return trial.value
        return self._judged(trial.params["batch_size"], trial.intermediate_values, trial.value)

    def _require_study(self) -> optuna.Study:
        if self.study is None:
            raise UserError("no study yet: call run() first.")
        return self.study

    # ------------------------------------------------------------------------- outputs

    def save_plots(self, summary: dict | None = None) -> list[Path]:
        """optuna_history.{html,png}, optuna_importance.html (when computable), best_params.json
        (from `summary`, the run's decision, when given; else the study's summary())."""
        study = self._require_study()
        import optuna.visualization as vis  # imported late: it loads plotly
        written: list[Path] = []
        complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]

        # Plotly's JS goes next to the pages once, not inlined or from a CDN: works offline.
        path = self.output_dir / "optuna_history.html"
        history = vis.plot_optimization_history(study, target_name="validation accuracy")
        # the values are fractions: shown in %, as the PNG and every other chart show them
        history.update_yaxes(tickformat=".0%")
        history.update_layout(title="Search history: each trial's validation accuracy")
        write_html(history, path)
        written.append(path)

        # Importances fit a model to (params -> value): it needs two results and some variation.
        varying = len({json.dumps(t.params, sort_keys=True) for t in complete}) >= 2
        drawn = False
        if varying:
            path = self.output_dir / "optuna_importance.html"
            # A chart must not fail a finished search: the evaluator can refuse its trials
            # (Optuna 4's fANOVA raised on trials of one value, all at chance, and needed
            # scikit-learn).
            try:
                with warnings.catch_warnings():  # "importances will be equal" on few trials:
                    warnings.simplefilter("ignore", UserWarning)  # the chart shows it
                    write_html(vis.plot_param_importances(study), path)
                    written += [path, self._importance_png(study)]
                drawn = True
            except (ImportError, RuntimeError, ValueError) as exc:
                log.warning("parameter importances not drawn: %s", first_line(exc))
        else:
            log.info("skipping parameter importances: need >= 2 complete trials with different "
                     "params, have %d complete", len(complete))
        if not drawn:
            for stale in ("optuna_importance.html", "optuna_importance.png"):  # an earlier run's
                (self.output_dir / stale).unlink(missing_ok=True)

        written.append(self._history_png(complete))
        path = self.output_dir / "best_params.json"
        summary = summary or self.summary()
        # The study's best is not always what the final run trains (choice): both, and why.
        kept = {k: summary[k] for k in ("best_params", "best_value", "keeps_default", "choice",
                                        "n_trials", "n_complete", "n_pruned", "n_failed")}
        kept["trained_params"] = summary["chosen_params"] or self.searched(self.default_config())
        kept["study_name"] = self.study_name  # hpo-<dataset>-<run>: which run's search
        atomic_write_text(json.dumps(kept, indent=2, sort_keys=True), path)
        written.append(path)
        return written

    def _importance_png(self, study: optuna.Study) -> Path:
        importances = optuna.importance.get_param_importances(study)
        fig = figure(6, 0.6 + 0.5 * len(importances))
        ax = fig.add_subplot()
        names = list(importances)[::-1]
        ax.barh(names, [importances[n] for n in names], color="tab:blue")
        ax.set(xlabel="importance (share of the validation accuracy's variance)",
               title="Which hyperparameters mattered")
        path = self.output_dir / "optuna_importance.png"
        atomic_save_figure(fig, path, dpi=100, bbox_inches="tight")
        return path

    def _history_png(self, complete: list[optuna.trial.FrozenTrial]) -> Path:
        fig = figure(6, 4)
        ax = fig.add_subplot()
        numbers = [t.number for t in complete]
        values = [100 * t.value for t in complete]  # percent, as every other chart
        best = [max(values[:i + 1]) for i in range(len(values))]
        ax.scatter(numbers, values, label="trial val acc", s=18)
        ax.step(numbers, best, where="post", color="tab:red", label="best so far")
        ax.set(xlabel="trial", ylabel="validation accuracy (%)", title=f"Optuna: {self.study_name}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best")
        path = self.output_dir / "optuna_history.png"
        atomic_save_figure(fig, path, dpi=100, bbox_inches="tight")
        return path


class _Pruned(Exception):
    """Rank 0's study pruned the trial this rank trains with it."""


def follow_trials(index) -> None:
    """Under torchrun, on every rank but 0: train each trial rank 0's study starts, data-parallel
    with it (the same configuration, a share of each batch), stopping where rank 0 prunes it,
    until end_trials(). Trials run on all ranks together rather than one per rank: the batch
    searched is the global batch the final run trains, and the study needs no storage that
    several processes write at once."""
    while (config := distributed.expect(distributed.from_main(None))) is not None:
        def on_epoch(epoch: int, metrics: dict[str, float]) -> None:
            if distributed.from_main(None):
                raise _Pruned
        try:
            fit(index, config, on_epoch=on_epoch)
        except (_Pruned, DivergedError):  # rank 0 records the trial as pruned
            pass


def end_trials() -> None:
    """On rank 0 under torchrun, after the study: the other ranks' follow_trials returns."""
    distributed.from_main(None)
