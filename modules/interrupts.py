"""Ctrl-C (Colab's Stop button) that stops a run wherever it lands.

Python runs a SIGINT handler between two bytecodes of whatever code runs then. When that is a
weakref callback or a __del__ (a library's cache entry dropped as a batch's tensors are
freed), the KeyboardInterrupt it raises cannot propagate: Python prints "Exception ignored in
..." and goes on, and the run trained to its end. Under `stoppable()` a press is remembered,
and `check()`, called at every training and evaluation batch, raises it again."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_pressed = False


def _on_sigint(signum, frame) -> None:
    global _pressed
    _pressed = True
    raise KeyboardInterrupt


@contextmanager
def stoppable() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt as Python's own handler does, and is remembered for
    check(). Only where Python's own handler is the one installed, in the main thread: a
    process started with SIGINT ignored (nohup, a background job) or a host with its own
    handler keeps it."""
    global _pressed
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _pressed = False
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _pressed = False


def check() -> None:
    """Raise KeyboardInterrupt again when Ctrl-C was pressed and Python dropped it."""
    if _pressed:
        raise KeyboardInterrupt
