"""Each demo run in a fresh process of its own, without importing torch anew for each.

A run's figures (its peak RSS, its allocator's peaks) must be its own, so every run gets a new
process. Spawning one per run imports torch and the package each time (3 to 4 s on a 2-core
machine: more than a small run trains). The demo's own process cannot fork: torch has run
kernels there, and OpenMP's and CUDA's thread pools do not survive a fork. So on Linux one
spawned process, the forker, imports the runs' code, runs none of it, and forks a child for
each run, as a DataLoader forks its workers after ``import torch``. Elsewhere (no fork on
Windows; macOS's system libraries are not safe to fork) each run is spawned.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

InFreshProcess = Callable[..., Any]


@contextlib.contextmanager
def fresh_processes() -> Iterator[InFreshProcess]:
    """Yields ``run(function, *args)``: ``function(*args)`` in a fresh process, its result
    returned, its error raised here with the traceback from that process as the cause."""
    if not sys.platform.startswith("linux"):
        yield _spawned
        return
    spawn = multiprocessing.get_context("spawn")
    requests, theirs = spawn.Pipe()
    forker = spawn.Process(target=_fork_each, args=(theirs,))
    forker.start()
    theirs.close()

    def forked(function: Callable[..., Any], *args: Any) -> Any:
        requests.send_bytes(pickle.dumps((function, args), protocol=5))
        return _result(requests, lambda: _exit_code(forker))

    try:
        yield forked
    finally:
        requests.close()  # the forker reads the end of its pipe and returns
        forker.join()


def _spawned(function: Callable[..., Any], *args: Any) -> Any:
    spawn = multiprocessing.get_context("spawn")
    receiver, sender = spawn.Pipe(duplex=False)
    process = spawn.Process(target=_reply, args=(sender, function, *args))
    process.start()
    sender.close()  # the child holds its own end: if it dies, recv() sees the end of file
    try:
        return _result(receiver, lambda: _exit_code(process))
    finally:
        process.join()


def _exit_code(process: multiprocessing.process.BaseProcess) -> int | None:
    process.join()
    return process.exitcode


@dataclass(frozen=True)
class _Ended:
    """A forked child that ended before it replied, and its exit code."""

    exit_code: int


def _result(receiver: Connection, exit_code: Callable[[], int | None]) -> Any:
    try:
        error, value = pickle.loads(receiver.recv_bytes())
    except EOFError:
        error, value = None, _Ended(exit_code() or 0)
    if isinstance(value, _Ended):
        raise RuntimeError(
            f"A demo run's process ended with exit code {value.exit_code} before reporting "
            "(a negative code is the signal that stopped it: -9 is often the out-of-memory "
            "killer)."
        ) from None
    if error is not None:
        raise value from _RemoteTraceback(error)
    return value


class _RemoteTraceback(Exception):
    """The traceback text of an error raised in a run's process."""


def _fork_each(requests: Connection) -> None:
    """The forker: each request's function and arguments unpickled here (which imports
    their modules once, for every later child too), then run in a forked child; the
    child's reply, or how it ended, sent back."""
    try:
        while True:
            try:
                function, args = pickle.loads(requests.recv_bytes())
            except EOFError:
                return  # the demo is over
            receiver, sender = multiprocessing.Pipe(duplex=False)
            pid = os.fork()
            if pid == 0:
                try:
                    requests.close()
                    receiver.close()
                    _reply(sender, function, *args)
                finally:
                    os._exit(1)  # a Ctrl-C, which the demo's process reports
            sender.close()
            try:
                reply = receiver.recv_bytes()
                os.waitpid(pid, 0)
            except EOFError:
                status = os.waitpid(pid, 0)[1]
                reply = pickle.dumps((None, _Ended(os.waitstatus_to_exitcode(status))))
            receiver.close()
            requests.send_bytes(reply)
    except KeyboardInterrupt:
        return  # Ctrl-C reached the demo's process as well, which reports it


def _reply(sender: Connection, function: Callable[..., Any], *args: Any) -> None:
    reply: tuple[str | None, Any]
    try:
        reply = (None, function(*args))
    except KeyboardInterrupt:
        return  # Ctrl-C reached the main process as well, which reports it
    except Exception as error:
        reply = (traceback.format_exc(), error)
    # Plain pickle copies the tensors into the message: multiprocessing's own pickler would
    # share them through file descriptors that vanish when this process exits. Protocol 5
    # (Python 3.8): the "medium" model's weights there and back in 0.19 s, not 0.33 s.
    sender.send_bytes(pickle.dumps(reply, protocol=5))
    # Replied: this process ends now, its output flushed, without the interpreter's
    # teardown (0.6 to 0.8 s with torch loaded, each run, which the parent waited for);
    # multiprocessing ends a forked child so too (os._exit). Nothing of a run needs it: the
    # operating system takes back its memory, files and devices.
    sender.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
