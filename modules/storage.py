"""Optuna's storage: the RDBStorage that also retries trials killed before their first
heartbeat, storage URLs opened and checked (retried while another worker creates the tables),
SQLite copies, and URLs and command lines shown without their secrets."""
from __future__ import annotations

import contextlib
import copy
import errno
import os
import random
import re
import sqlite3
import time
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import sqlalchemy

from modules.config import UserError, first_line

# Seconds between heartbeats of a running trial, and silence after which it counts as dead (a
# killed Colab kernel) and is retried. Several heartbeats fit in the grace period, so a busy
# epoch does not look like a crash.
# HWTRAIN_TRIAL_GRACE_S shortens or lengthens the grace period (epochs longer than a minute on
# a shared cluster; the real-kill test); heartbeats come three times per grace period.
try:
    GRACE_S = max(2.0, float(os.environ.get("HWTRAIN_TRIAL_GRACE_S", 90)))
except ValueError:  # not a number: keep the default rather than fail at import
    GRACE_S = 90.0
HEARTBEAT_S, MAX_RETRY = max(1, int(GRACE_S // 3)), 2
SQLITE_WAIT_S = 60.0


class Storage(optuna.storages.RDBStorage):
    """Optuna's RDBStorage, whose stale trials also take in a trial that never beat: RUNNING,
    without a heartbeat, started more than the grace period ago.

    Optuna only looks at trials with a heartbeat. Its heartbeat thread records the first one
    shortly after the trial is created (later when SQLite is busy with the trial's own
    writes), so a process killed in between left its trial RUNNING for ever, never failed
    and never retried. A live trial beats within milliseconds of its start, so one without a
    heartbeat after the whole grace period is dead. (Its start is the creating process's
    local time: workers sharing a study should share a clock and time zone.)"""

    all_stale = False  # every RUNNING trial is stale (OptunaTuner._retry_cut_off)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        if self.all_stale:
            return [t._trial_id for t in self.get_all_trials(
                study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))]
        stale = super()._get_stale_trial_ids(study_id)
        grace = timedelta(seconds=self.grace_period or 2 * self.heartbeat_interval)
        now = datetime.now()
        for trial in self.get_all_trials(study_id, deepcopy=False,
                                         states=(optuna.trial.TrialState.RUNNING,)):
            if trial._trial_id not in stale and trial.datetime_start is not None and \
                    now - trial.datetime_start > grace and not self._has_heartbeat(trial._trial_id):
                stale.append(trial._trial_id)
        return stale

    def _has_heartbeat(self, trial_id: int) -> bool:
        try:  # Optuna's own tables, as its record_heartbeat reads them (3.5 to 5.0)
            from optuna.storages._rdb import models
            from optuna.storages._rdb.storage import _create_scoped_session
            with _create_scoped_session(self.scoped_session) as session:
                return models.TrialHeartbeatModel.where_trial_id(trial_id, session) is not None
        except Exception:  # an Optuna whose internals differ: leave the trial to Optuna's rule
            return True


def storage_error(url: str, exc: Exception) -> UserError:
    first = scrub(first_line(exc, limit=1000), url)
    damaged = url.startswith("sqlite") and any(
        words in first.lower() for words in ("malformed", "not a database"))
    return UserError(f"cannot open Optuna storage {without_password(url)!r} "
                     f"({type(exc).__name__}: {first})" + (
                         ": the file is damaged; move it away to start the search over (its "
                         "trials are trained again)" if damaged else "") + ".")


def check_storage(url: str) -> None:
    """Opens a --storage URL once, so that a wrong one stops the run before any training."""
    if re.fullmatch(r"sqlite:/{2,3}(:memory:)?", url.strip()):
        raise UserError(f"--storage {url!r} is an in-memory SQLite database, gone when the run "
                        "ends and unseen by other workers; give a file: sqlite:///path/optuna.db")
    try:
        opened(lambda: optuna.storages.RDBStorage(url)).engine.dispose()
    except Exception as exc:  # as in OptunaTuner._storage
        raise storage_error(url, exc) from None


CREATION_TRIES = 5


def retry_callback():
    """Optuna's callback that queues a trial cut off by a kill again, without the successive
    halving rungs the cut-off trial had passed: copied, they told the pruner the retry had
    passed them too, and it was not judged at its first rung however far behind (and the pool
    there held the cut-off run's value twice)."""
    class Retry(optuna.storages.RetryHeartbeatStaleTrialCallback):
        def __call__(self, study, trial):
            trial = copy.deepcopy(trial)
            trial.system_attrs = {k: v for k, v in trial.system_attrs.items()
                                  if not k.startswith("completed_rung_")}
            super().__call__(study, trial)
    return Retry(max_retry=MAX_RETRY)


def opened(open_storage):
    """open_storage(), tried again when another worker was creating the storage's tables at
    the same moment: the first open of an empty database creates them, and of two workers of
    a job array started together one failed ("table alembic_version already exists",
    "duplicate key value violates unique constraint")."""
    for attempt in range(1, CREATION_TRIES + 1):
        try:
            return open_storage()
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError,
                sqlalchemy.exc.ProgrammingError) as exc:
            text = str(exc).lower()
            racing = any(s in text for s in ("already exists", "unique constraint",
                                             "duplicate key", "database is locked"))
            if not racing or attempt == CREATION_TRIES:
                raise
            time.sleep(random.uniform(0.2, 1.0) * attempt)


def sqlite_url(path: Path) -> str:
    """The SQLAlchemy URL of a SQLite file, escaped: a folder named "run #2?" or "a%20b" is
    that folder, not a query string or a space."""
    return sqlalchemy.engine.URL.create("sqlite", database=str(Path(path).resolve())) \
        .render_as_string(hide_password=False)


def copy_sqlite(source: Path, target: Path) -> None:
    """A consistent copy of a live SQLite file (its backup API), replacing `target` whole. A
    copy cut short before (a disconnect mid-copy) is started again, not opened."""
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        with contextlib.closing(sqlite3.connect(source)) as src, \
                contextlib.closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)
    except sqlite3.Error as exc:
        with contextlib.suppress(OSError):  # a read-only or failing drive: the cause is exc
            tmp.unlink(missing_ok=True)
        raise copy_error(source, target, exc) from None
    os.replace(tmp, target)


# SQLite's primary result codes (sqlite3.Error.sqlite_errorcode from Python 3.11; its message
# before that): what a failed copy says depends on them.
SQLITE_CAUSES = {8: "readonly", 10: "io", 11: "damaged", 13: "full", 14: "cantopen",
                 26: "damaged"}
SQLITE_TEXTS = (("database or disk is full", "full"), ("disk i/o error", "io"),
                ("readonly database", "readonly"), ("unable to open", "cantopen"),
                ("malformed", "damaged"), ("not a database", "damaged"))


def copy_error(source: Path, target: Path, exc: sqlite3.Error) -> UserError:
    """The one line for a copy of the study that failed. Only a damaged source is to be moved
    aside: a full disk, a drive that failed or refused the write, leave both copies as they
    were, and the run goes on from them with --resume (the study moved aside would be searched
    again from its first trial)."""
    from modules.files import RESUME, ReadFailed, write_error
    code = getattr(exc, "sqlite_errorcode", None)
    cause = SQLITE_CAUSES.get(code & 0xFF) if isinstance(code, int) else None
    if cause is None:
        text = str(exc).lower()
        cause = next((kind for words, kind in SQLITE_TEXTS if words in text), None)
    what = f"the Optuna study {str(source)!r} to {str(target)!r}"
    if cause == "full":  # the copy's writes, beside target
        return write_error(target, OSError(errno.ENOSPC, str(exc)), in_run=True)
    if cause == "io":
        return ReadFailed(f"could not copy {what} ({exc}): the disk or network drive failed; "
                          f"check it, {RESUME}")
    if cause == "damaged":
        return UserError(f"cannot copy {what} ({exc}): {str(source)!r} is damaged; move it "
                         "aside and run again.")
    return ReadFailed(f"cannot copy {what} ({exc}); check that both folders can be read and "
                      f"written, {RESUME}")


def local_dir_unused(storage: str | None, local_dir: str | None) -> str | None:
    """The line for a --local-dir given with a --storage URL, which the study then lives in
    (nothing is copied): said, since a SQLite --storage on a network drive (Google Drive) is
    what --local-dir is for; None when there is nothing to say."""
    if not storage or not local_dir:
        return None
    where = without_password(storage)
    if storage.strip().lower().startswith("sqlite"):
        return (f"the study is in --storage {where!r}, where it is written directly; "
                "--local-dir keeps only the generated data, not the study (SQLite's locking "
                "is unsafe on a network drive such as Google Drive: put that file on a local "
                "disk)")
    return f"the study is in --storage {where!r}; --local-dir keeps only the generated data"


def storage_cause(exc: BaseException) -> BaseException | None:
    """The storage error `exc` is or arose from (Optuna can fail on with another exception,
    an UnboundLocalError, while handling one), or None: the database's own when there is one
    ("database is locked"), not Optuna's wrapper of it."""
    chain: list[BaseException] = []
    while exc is not None and len(chain) < 10:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for kinds in ((sqlalchemy.exc.SQLAlchemyError, sqlite3.Error),
                  (optuna.exceptions.StorageInternalError,)):
        found = next((e for e in chain if isinstance(e, kinds)), None)
        if found is not None:
            return found
    return None


def scrub(text: str, url: str) -> str:
    """`text` (a driver's error message) without any piece of the URL's user and password: a
    driver that misreads an unencoded '@' quotes the password's tail as the host."""
    url = str(url)
    start = url.find("://") + 3
    userinfo = url[start:url.rfind("@")] if "@" in url[start:] else ""
    pieces = {userinfo} | set(re.split(r"[:@/?&=]", userinfo))
    query = url.split("?", 1)[1] if "?" in url else ""
    pieces |= {value for _, _, value in (part.partition("=") for part in query.split("&"))}
    for piece in sorted((p for p in pieces if len(p) >= 3), key=len, reverse=True):
        text = text.replace(piece, "***")
    return text


def shown_argv(argv: list[str]) -> list[str]:
    """A command line as it may be logged or saved (run.json, latest_run.json): a --storage
    URL's user, password and query left out, as everywhere else it is shown."""
    shown, storage_next = [], False
    for arg in argv:
        # argparse takes any unambiguous start of an option's name: --stor is --storage
        name, eq, value = arg.partition("=")
        is_storage = len(name) >= 4 and "--storage".startswith(name)
        if storage_next:
            arg, storage_next = without_password(arg), False
        elif is_storage and not eq:
            storage_next = True
        elif is_storage:
            arg = f"{name}={without_password(value)}"
        shown.append(arg)
    return shown


def without_password(url: str) -> str:
    """The storage URL as it may be logged or written to results.json: driver, host, port and
    database only, never user, password or query string, however the URL is written."""
    url = str(url)
    driver = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", url)
    if driver is None:
        return "<unparseable>"
    rest = url[driver.end():]
    if rest.startswith("/"):  # no host part (sqlite:///path/optuna.db): the path is shown
        return f"{driver[1]}://{re.split(r'[?#]', rest, maxsplit=1)[0]}"
    # rest is [userinfo@]host[:port][/database][?query]. An unencoded password may hold "@",
    # "/" or "?", and a query "@", so every "@" is tried as the end of the userinfo; exactly
    # one reading must fit, since with two, what is shown could be part of a secret.
    tail = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[\w.~%-]*)(?::(\d{1,5}))?(/[^?#@]*)?(?:[?#].*)?",
                      re.DOTALL)
    readings = {m.group(1, 2, 3) for at in [-1] + [i for i, c in enumerate(rest) if c == "@"]
                if (m := tail.fullmatch(rest, at + 1))}
    if len(readings) != 1:
        return f"{driver[1]}://<unparseable>"
    host, port, database = readings.pop()
    return f"{driver[1]}://{host}{':' + port if port else ''}{database or ''}"
