"""How a process that joined a process group leaves it.

`end_process_group` makes every rank wait for the others, so none tears the group down while
a peer still talks over it; collects what still holds communication state (models,
optimizers, their pending work) while the group is alive; then destroys the group, as
PyTorch asks before exit.

`leave` then ends the process without interpreter finalization. Gloo's worker threads can
still hold tensors after the group is gone, and finalization frees them without the GIL: the
process aborts ("terminate called without an active exception", SIGABRT) after all its work
is done, and torchrun reports the whole run as failed (pytorch/pytorch#179291 describes the
race). Every ember command that ran under torchrun ends this way.

`sigterm_unwinds` makes SIGTERM (`kill`, a scheduler's cancel) end a command as Ctrl-C does,
through its `finally` and `with` blocks, so the worker processes it started are stopped and
what it finished is written.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn


def end_process_group() -> None:
    """Leave the default process group, if this process joined one; every rank must call it."""
    import torch.distributed as dist  # here: `ember --help` does not wait for torch

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def leave(code: int) -> NoReturn:
    """End the process now with exit status `code`, its output flushed. A command that
    failed part way may not have ended its group: peers that did not fail would wait for it
    at the barrier, so the group is left to die with the process."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it anyway
            pass
    os._exit(code)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within it, SIGTERM raises SystemExit(143) instead of killing the process outright.
    Only the main thread can take signals: called from another, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
