"""Which final run the hpo row keeps, and how its seconds count: its own, the resolution
scenario's when it would learn the same or validated higher, or the one a grown study set
aside; the tuning seconds each choice carries, and what TensorBoard's hpo run shows."""
from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from modules import distributed
from modules.clock import write_clock
from modules.config import TrainConfig, UserError, first_line
from modules.dataset import DatasetIndex
from modules.files import share_file
from modules.models import start_weights
from modules.results import CLOCK_SUFFIX, checkpoint_file, previous_row, run_folder

log = logging.getLogger("scenario")  # the run log names its lines as when they were in scenario.py


def row_tuning_s(tuning_s: float, reused_s: float, before: dict[str, Any] | None,
                 clock: Path | None) -> float:
    """The row's tuning seconds: the clock's `tuning_s` (this scenario's own time) and
    `reused_s` (a trial it took from the resolution scenario). `before`: the row of a resumed
    session that found the scenario finished, and tuned nothing anew, so only read back what
    the run had done: the row keeps the tuning seconds the run took (each resume added its own
    before, and with them to total_s and the time ratios), and so does the clock (less the
    reused trial's, which the row adds to it)."""
    seconds = None if before is None else before.get("tuning_s")
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return tuning_s + reused_s
    if clock is not None and distributed.is_main():
        write_clock(clock, seconds - reused_seconds(before))
    return float(seconds)


def reused_seconds(extra: dict[str, Any]) -> float:
    """Seconds the hpo row counts of the resolution scenario's tuning (0 for other
    scenarios), from a row or the tuning's extra: its default trial, taken from there, and
    the rest of that tuning where the row takes that scenario's model (taken_tuning_s)."""
    summary = extra.get("hpo") or {}
    return sum(float(s) for s in (summary.get("default_reused_s"),
                                  summary.get("resolution_tuning_s"))
               if isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0)


def taken_tuning_s(extra: dict[str, Any], same: dict[str, Any], reused_s: float) -> float:
    """The resolution scenario's tuning beyond the trial the hpo scenario took from it
    (`reused_s`: the speed knobs it measured, the other sizes it tried), when the hpo row
    takes that scenario's model (`same`, as tuned["final"] holds it): that model came of all
    of it, so the row counts it before its own search (`hpo.resolution_tuning_s`), the start
    trial's curve placed after it. Without it the same model read faster in the hpo row than
    in the resolution row wherever the search took less than the rest of that tuning."""
    source_s = same.get("tuning_s", same["row"].get("tuning_s"))
    rest = max(0.0, float(source_s or 0.0) - reused_s)
    if rest > 0 and isinstance(extra.get("hpo"), dict):
        extra["hpo"]["resolution_tuning_s"] = rest
        for point in (extra.get("warm_start") or {}).get("curve") or []:
            point["elapsed_s"] += rest
    return rest


def keep_timeline(row: dict[str, Any], carried: dict[str, Any],
                  warm: dict[str, Any] | None) -> None:
    """A final run found finished on --resume: its seconds are those of the session that
    trained it, in place. This session only evaluated; its preparation (a decode the tuning
    had done then) and the start trial's epochs, trained in that session (lineage leaves
    them out), would change when the row reaches the baseline's accuracy."""
    row.update({k: carried[k] for k in ("final_from", "prepare_s", "wall_s", "time_to_best_s",
                                        "replaced_final", "grown_final")
                if carried.get(k) is not None})
    if "resumed_from_epoch" in carried:  # this session resumed nothing: it evaluated
        row["resumed_from_epoch"] = carried["resumed_from_epoch"]
    keep_start_curve(warm, carried)


def keep_start_curve(warm: dict[str, Any] | None, before: dict[str, Any]) -> None:
    """The start trial's curve as the row `before` placed it, in place, when the final run
    continues from the same trial: trained in an earlier session, lineage cannot place it."""
    earlier = before.get("warm_start") or {}
    if warm is not None and same_weights(earlier.get("weights"), warm.get("weights")):
        warm["curve"] = earlier.get("curve") or []


def same_weights(recorded: str | None, now: str | None) -> bool:
    """Whether a row's start weights are the file a resumed session starts from: its run's
    folder and name, wherever the output dir is now (a copy, Drive mounted elsewhere)."""
    return recorded is not None and now is not None and \
        Path(recorded).parts[-2:] == Path(now).parts[-2:]


def final_run_s(row: dict[str, Any]) -> float:
    """Seconds of a row's final run: its preparation (the model, the cache's decode) and its
    training."""
    return (row.get("prepare_s") or 0.0) + row["wall_s"]


def final_to_reuse(name: str, config: TrainConfig, tuned: dict[str, Any]
                   ) -> dict[str, Any] | None:
    """The resolution scenario's final run, for the hpo scenario whose final run would learn
    the same: every learning setting equal, the start weights and epochs included. Speed knobs
    aside: the hpo scenario measures them at the picked size, the resolution scenario at the
    baseline's, and they change how fast a run goes, not what it learns."""
    same = tuned.get("final")
    if name == "hpo" and same is not None and \
            same["config"].learning_settings() == config.learning_settings():
        return same
    return None


def same_final(same: dict[str, Any], extra: dict[str, Any], run_id: str | None, weights: str,
               output_dir: Path, tuning_s: float) -> dict[str, Any]:
    """The hpo scenario's row when its final run would learn what the resolution scenario's
    final learned: the search kept the default configuration, which continues from the same
    trial's weights for the same epochs. Trained twice with the same speed knobs, the two end
    identically, so the earlier run's model and figures (its knobs in `settings`) are taken
    instead. total_s counts that final run's time as if trained here, so the row compares with
    a run that does train it; only the run's wall time is shorter."""
    row = copy.deepcopy(same["row"])
    log.info("hpo: the final run would learn what the %s scenario's final run learned (the "
             "same settings, start and %d epochs): taking its model and figures instead of "
             "training it again (%.0f s saved)", same["scenario"], same["config"].epochs,
             row["wall_s"])
    if distributed.is_main():
        # Its checkpoint is that run's: --resume then finds the hpo final finished, as it would
        # have had it trained; TensorBoard shows its curves beside the other scenarios'.
        runs = run_folder(output_dir, "runs", run_id)
        try:
            share_file(checkpoint_file(output_dir, same["scenario"], run_id=run_id),
                       checkpoint_file(output_dir, "hpo", run_id=run_id))
            if (runs / same["scenario"]).is_dir():
                shutil.copytree(runs / same["scenario"], runs / "hpo", dirs_exist_ok=True)
        except (OSError, UserError) as exc:  # UserError: the copy's write failed
            log.warning("hpo: could not give it the %s final's checkpoint and scalars (%s): "
                        "--resume would train its final run", same["scenario"], first_line(exc))
    row.update(extra, scenario="hpo", run_id=run_id, tuning_s=tuning_s,
               total_s=tuning_s + final_run_s(row),
               final_from=same["scenario"],
               start_weights=start_weights(row["model"], weights))
    log_row(row)
    return row


def resolution_final_row(output_dir: Path, index: DatasetIndex, run_id: str | None
                         ) -> dict[str, Any] | None:
    """This run's resolution final run as a row from results.json (a resumed run whose
    resolution scenario ran in an earlier session), in the form tuned["final"] has."""
    row = previous_row(output_dir / "results.json", "resolution", index.name, run_id)
    return {"scenario": "resolution", "row": row} if row else None


def gave_way(row: dict[str, Any]) -> dict[str, Any]:
    """What an hpo row keeps of a final run that validated below the one it took instead
    (winner_final, default_final, grown_final: the report quotes them; a resume that finds
    that run finished reads its history and seconds back, own_run)."""
    return {k: row.get(k) for k in ("val_acc", "test_acc", "epochs", "wall_s", "settings",
                                    "prepare_s", "tuning_s", "history")}


def own_run(row: dict[str, Any] | None, history: Any) -> dict[str, Any] | None:
    """The earlier row of a final run found finished on --resume: `row` itself when its
    history is `history` (the checkpoint's), or, where the hpo row took another run's model,
    the record of its own run that gave way (its times, the row's search summary)."""
    if row is None or row.get("history") == history:
        return row
    own = next((row[k] for k in ("winner_final", "default_final")
                if isinstance(row.get(k), dict) and row[k].get("history") == history), None)
    if own is None:
        return None
    # its own run counted only its own tuning, not that of the run taken instead
    summary = {k: v for k, v in (row.get("hpo") or {}).items() if k != "resolution_tuning_s"}
    return {**{k: v for k, v in own.items() if v is not None}, "hpo": summary}


def default_if_better(row: dict[str, Any], same: dict[str, Any] | None) -> dict[str, Any]:
    """The hpo row after its own final run: the default configuration's final run instead when
    that validated higher. The resolution scenario's final run is that run when the search's
    default trial was its trial (the same learning settings, continued from the same weights).
    Against the search's winner: the winner was chosen on short trials, and its lead there
    (learning fastest early, from scratch often a draw of the augmentation) need not last a
    full run. Against a kept default trained again (its time-matched epochs differed from
    that run's): two runs of one configuration from one start, the better validated kept.
    `same`: that run, as tuned["final"] holds it (or resolution_final_row gives it). Its
    tuning_s counts its own final run (a candidate it trained), total_s adds the taken run's
    time as same_final does, and `winner_final` (or `default_final`) keeps the figures of the
    run that gave way."""
    summary = row.get("hpo") or {}
    if not summary.get("default_reused_from") or same is None:
        return row
    if summary.get("keeps_default") and (row.get("settings") or {}).get("weights") != \
            (same["row"].get("settings") or {}).get("weights"):
        return row  # the default trained from another start (a shared study's worker's trial)
    mine, default = row.get("val_acc"), same["row"].get("val_acc")
    if mine is None or default is None or mine >= default:
        return row
    own = "default" if summary.get("keeps_default") else "winner"
    log.info("hpo: the %s's final run (%s epochs) validated at %.1f%%, below the default "
             "configuration's (the %s scenario's final run, %s epochs, %.1f%%): keeping that "
             "model", own, row.get("epochs"), 100 * mine, same["scenario"],
             same["row"].get("epochs"), 100 * default)
    kept = copy.deepcopy(same["row"])
    for key in ("warm_start", "resolution_trials"):  # the resolution scenario's own, timed
        kept.pop(key, None)                          # from its start, not the hpo scenario's
    kept.pop("tuning_load", None)  # the resolution scenario's (a row from results.json)
    kept.update({k: copy.deepcopy(row[k]) for k in ("hpo", "autotune", "tuning_load", "run_id",
                                                    "start_weights")
                 if k in row}, scenario="hpo", final_from=same["scenario"],
                **{f"{own}_final": gave_way(row)})
    tuning_s = row["total_s"] + taken_tuning_s(kept, same, reused_seconds(row))
    # as same_final counts the model taken
    kept.update(tuning_s=tuning_s, total_s=tuning_s + final_run_s(kept))
    return kept


EARLIER_ROW = "_row"  # the replaced final run's row, inside replaced_final until compared
# A replaced final run set aside in an earlier session: its seconds are in the clock already.
COUNTED = "_counted"


def replaced_record(output_dir: Path, run_id: str) -> Path:
    """Where a set-aside final run is recorded until the new one is compared with it (a new
    final run cut short, then resumed, is compared all the same)."""
    return checkpoint_file(output_dir, "hpo", ".replaced.json", run_id)


def forget_replaced(output_dir: Path, run_id: str) -> None:
    if distributed.is_main():
        replaced_record(output_dir, run_id).unlink(missing_ok=True)


def pending_replaced(output_dir: Path, run_id: str) -> dict[str, Any] | None:
    """The final run an earlier session set aside for a grown study's new choice, whose new
    final run that session did not finish: compared with it when this session finishes it.
    None when there is none, or its checkpoint is gone."""
    path = replaced_record(output_dir, run_id)
    try:
        replaced = json.loads(path.read_text())
        if not isinstance(replaced, dict) or not Path(replaced["checkpoint"]).is_file():
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    log.info("hpo: the final run before the study grew (%s) is compared with this one when it "
             "ends", replaced["checkpoint"])
    return {**replaced, COUNTED: True}


def earlier_if_better(row: dict[str, Any], replaced: dict[str, Any] | None,
                      earlier: dict[str, Any] | None, output_dir: Path, run_id: str
                      ) -> dict[str, Any]:
    """The hpo row after a grown study's new choice was trained: the earlier final run's row
    (`earlier`, set aside as `replaced` says) instead, when that validated higher; as with
    default_if_better, a lead on short trials need not last a full run. Its checkpoint comes
    back as the hpo checkpoint (the new one kept aside), so a later --resume continues the
    model the row shows. tuning_s counts the new final run instead of the earlier one, and
    `grown_final` keeps the new run's figures."""
    if earlier is None or replaced is None:
        return row
    mine, before = row.get("val_acc"), earlier.get("val_acc")
    if mine is None or before is None or mine >= before:
        return row
    final = checkpoint_file(output_dir, "hpo", run_id=run_id)
    if distributed.is_main():
        grown = f"grown-{time.strftime('%Y%m%d-%H%M%S')}"
        aside = final.with_name(f"hpo.{grown}.pt")
        try:
            final.rename(aside)
            try:
                Path(replaced["checkpoint"]).rename(final)
            except OSError:
                aside.rename(final)  # else --resume would find no hpo checkpoint, and train again
                raise
        except OSError as exc:  # the new run stays the hpo checkpoint, and its row with it
            log.warning("hpo: could not bring back the earlier final run's checkpoint (%s): "
                        "keeping the new final run", first_line(exc))
            return row
        show_in_tensorboard(run_folder(output_dir, "runs", run_id), aside=grown,
                            kept=Path(replaced["scalars"]) if replaced.get("scalars") else None)
    log.info("hpo: the new final run validated at %.1f%%, below the final run before the "
             "study grew (%.1f%%): keeping that model", 100 * mine, 100 * before)
    kept = copy.deepcopy(earlier)
    kept.pop("replaced_final", None)
    kept.update({k: row[k] for k in ("hpo", "autotune", "tuning_load", "run_id") if k in row},
                tuning_s=row["total_s"] - replaced["seconds"], total_s=row["total_s"],
                grown_final=gave_way(row))
    if distributed.is_main():  # a later --resume counts the kept run once, as its final run
        write_clock(checkpoint_file(output_dir, "hpo", CLOCK_SUFFIX, run_id), kept["tuning_s"])
    return kept


SHOWN_FROM = "shown_from.txt"  # in runs/<run>/hpo: the scenario whose scalars were copied there


def show_in_tensorboard(runs: Path, *, aside: str, kept: Path | None, copy: bool = False
                        ) -> None:
    """TensorBoard's hpo run shows the final run the row keeps: the scalars of the run that
    gave way move to hpo.<aside>, and the kept run's take their place (copied from the
    resolution scenario's folder, or moved back from where a grown study set them aside)."""
    shown = runs / "hpo" / SHOWN_FROM
    try:
        if copy and kept is not None and shown.is_file() and shown.read_text() == kept.name:
            return  # a --resume that found the run finished: already shown
        if (runs / "hpo").is_dir():
            (runs / "hpo").rename(runs / f"hpo.{aside}")
        if kept is not None and kept.is_dir():
            if copy:
                shutil.copytree(kept, runs / "hpo")
                shown.write_text(kept.name)
            else:
                kept.rename(runs / "hpo")
    except OSError as exc:
        log.warning("hpo: TensorBoard's hpo run may show another final run than the row (%s)",
                    first_line(exc))


def log_row(row: dict[str, Any]) -> None:
    log.info("%s: test accuracy %.1f%% (val %.1f%% +- %.1f at epoch %d) in %.0f s, %.0f s of "
             "it tuning", row["scenario"], 100 * row["test_acc"], 100 * row["val_acc"],
             100 * row["val_acc_se"], row["best_epoch"], row["total_s"], row["tuning_s"])
    log.info("%s: %s", row["scenario"], row["diagnosis"]["summary"])
