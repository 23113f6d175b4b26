"""The scenario clock: a tuned scenario's tuning seconds, kept in a file while it tunes so that
a resumed run's row counts every session's (`tuning_s`, docs/tuning.md)."""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from modules.config import UserError, first_line
from modules.files import io_failed
from modules.results import write_json

log = logging.getLogger("scenario")  # the run log names its lines as when they were in scenario.py


class Kept(NamedTuple):
    """What a scenario's clock file holds from the earlier sessions of this run."""
    seconds: float  # spent tuning the scenario (their tuning_s), so a resumed row counts them
    # [time.time() at each session's start, the clock's seconds then], oldest first (lineage
    # places a trial's epochs by them)
    sessions: list[list[float]]
    # the machine's load in each session (tuning_load's figures: wall_s, cpu_util_pct,
    # process_cpu_pct), oldest first
    loads: list[dict[str, Any]]


def read_kept(path: Path) -> Kept:
    """The clock file's figures, from one read of it (on Drive in Colab); each is none (0 s)
    when unreadable or written by a version without it. A session killed outside Python (a
    lost Colab VM) recorded its seconds up to CLOCK_EVERY_S before it ended (ticking)."""
    kept = _clock_file(path)
    return Kept(_seconds(kept), _sessions(kept), _loads(kept))


def _seconds(kept: Any) -> float:
    try:
        return max(0.0, float(kept["tuning_s"]))
    except (ValueError, KeyError, TypeError):
        return 0.0


def _sessions(kept: Any) -> list[list[float]]:
    try:
        return [[float(at), float(clock)] for at, clock in kept["sessions"]]
    except (ValueError, KeyError, TypeError):
        return []


def _loads(kept: Any) -> list[dict[str, Any]]:
    try:
        return [{k: float(v) if v is not None else None for k, v in load.items()}
                for load in kept["loads"] if float(load["wall_s"]) >= 0]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def _clock_file(path: Path) -> Any:
    """What a tuning clock's file holds; None where there is none that reads. A read the disk
    or drive failed stops the run instead: taken for none, the row would drop those seconds."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        if (failed := io_failed(path, exc)) is not None:
            raise failed from None
        return None


CLOCK_EVERY_S = 10.0  # how often a tuning session records its seconds so far


@contextlib.contextmanager
def ticking(path: Path, earlier_s: float, started: float,
            sessions: list[list[float]] | None = None):
    """While tuning, the clock is written every CLOCK_EVERY_S from a background thread, so a
    session killed outside Python (kill -9, a lost Colab VM: no finally runs) leaves its
    seconds up to then for the resumed row (and `sessions`: read_kept)."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(CLOCK_EVERY_S):
            write_clock(path, earlier_s + time.perf_counter() - started, sessions)
    thread = threading.Thread(target=tick, name="tuning-clock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def write_clock(path: Path, tuning_s: float, sessions: list[list[float]] | None = None,
                loads: list[dict[str, Any]] | None = None) -> None:
    """The scenario's tuning seconds so far, its sessions and the machine's load in each that
    ended (None: those recorded)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # one read for what is kept (the ticking thread writes every CLOCK_EVERY_S, on Drive too)
        kept = _clock_file(path) if sessions is None or loads is None else None
        write_json(path, {"tuning_s": tuning_s,
                          "sessions": _sessions(kept) if sessions is None else sessions,
                          "loads": _loads(kept) if loads is None else loads})
    except (OSError, UserError) as exc:  # a clock not written costs only a resumed row's time
        log.info("could not write %s (%s)", path, first_line(exc))
