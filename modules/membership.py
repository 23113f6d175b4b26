"""Which images a model trained on, so that a run starting from it can count the images it
would test or choose on that the model has already seen: a short digest of each training
image's bytes, kept with the run (checkpoints/<run>/trained_on.json, beside its checkpoints and
trials' weights) and in the model file it saves. By content, not by name: a moved, renamed or
re-split copy of an image is the same image; a resized or re-encoded one is not counted."""
from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from modules.dataset import DatasetIndex, Sample, in_threads
from modules.files import atomic_write_text

DIGEST_BYTES = 8  # 2**-64 a chance that two different images share one
FILE_NAME = "trained_on.json"
# What a record says of the run behind it, as a model file's extra says it too
ABOUT = ("run_id", "seed", "quick", "images_fingerprint")


def _digest(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return hashlib.blake2b(f.read(), digest_size=DIGEST_BYTES).digest()
    except OSError:
        return None  # gone since it was listed: training says so when it reads it


def digests(samples: Iterable[Sample]) -> list[bytes | None]:
    """Each image's digest, in order (None where the file cannot be read now)."""
    return list(in_threads(_digest, [path for path, _ in samples]).values())


def of_images(samples: Iterable[Sample]) -> set[bytes]:
    """The digests of the images that can be read."""
    return {d for d in digests(samples) if d is not None}


def encode(seen: Iterable[bytes]) -> str:
    return base64.b64encode(b"".join(sorted(set(seen)))).decode("ascii")


def decode(text: Any) -> set[bytes] | None:
    """The digests `encode` wrote; None for anything else (a file of an older version)."""
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error
        return None
    if len(raw) % DIGEST_BYTES:
        return None
    return {raw[i:i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)}


def record(folder: Path, index: DatasetIndex, about: dict[str, Any],
           carried: set[bytes] = frozenset()) -> dict[str, Any]:
    """Write what a run trains on into its folder (kept when there already: a resumed run's)
    and return it: its training images, and `carried`, what the model it starts from had
    trained on, which its weights carry on."""
    path = Path(folder) / FILE_NAME
    kept = read(path.parent)
    if kept is not None:
        return kept
    mine = of_images(index.train) | set(carried)
    written = {**{k: about.get(k) for k in ABOUT}, "images": len(mine), "trained_on": encode(mine)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json.dumps(written), path)
    return written


def read(folder: Path) -> dict[str, Any] | None:
    """The record in a run's folder; None when there is none that reads."""
    try:
        kept = json.loads((Path(folder) / FILE_NAME).read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and decode(kept.get("trained_on")) is not None \
        else None


def of_start(path: Path, state: Any, model_format: str) -> tuple[set[bytes], dict] | None:
    """What a --weights file records of the images behind it, and of their run: a model file
    this tool saved says it in its extra; a checkpoint or a trial's weights in a run's
    checkpoints folder, by that run's record. None: nothing recorded (another tool's file, or
    an older version's)."""
    extra = state.get("extra") if isinstance(state, dict) and \
        state.get("format") == model_format else None
    if isinstance(extra, dict) and (seen := decode(extra.get("trained_on"))) is not None:
        return seen, extra
    kept = read(Path(path).parent)
    return None if kept is None else (decode(kept["trained_on"]), kept)


def count_seen(samples: list[Sample], seen: set[bytes]) -> int:
    """How many of `samples` are images in `seen`."""
    return sum(d in seen for d in digests(samples) if d is not None) if seen else 0
