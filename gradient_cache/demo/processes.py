"""Each demo run in a fresh process of its own, without importing torch anew for each.

A run's figures (its peak RSS, its allocator's peaks) must be its own, so every run gets a new
process. Spawning one per run imports torch and the package each time (3 to 4 s on a 2-core
machine: more than a small run trains) and, on Linux, starts as a fork of the demo's process,
whose peak RSS the run then keeps through the exec. The demo's own process cannot fork: torch
has run kernels there, and OpenMP's and CUDA's thread pools do not survive a fork. So on Linux
one spawned process, the forker, imports the runs' code, runs none of it, and forks a child for
each run, as a DataLoader forks its workers after ``import torch``. The forker holds nothing a
run made: a run's reply passes through it a chunk at a time. Elsewhere (no fork on Windows;
macOS's system libraries are not safe to fork) each run is spawned.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

InFreshProcess = Callable[..., Any]

CHUNK = 1 << 20  # a run's reply crosses the forker in pieces of this many bytes
# What a run's torch optimizer imports at its first add_param_group (torch._dynamo, 2.5 s
# of a start on two cores, which the package itself does not import): the forker imports
# it once, for every child.
PRELOAD = ("torch._dynamo",)
_PIECE, _ENDED = b"p", b"e"  # the forker's messages: a piece of the reply, the exit code


@contextlib.contextmanager
def fresh_processes(*, preload: tuple[str, ...] = PRELOAD) -> Iterator[InFreshProcess]:
    """Yields ``run(function, *args)``: ``function(*args)`` in a fresh process, its result
    returned, its error raised here with the traceback from that process as the cause. If
    the demo's process raises while a run is in flight, the run is stopped, not waited for.
    ``preload``: the modules the forker imports before its first run (Linux)."""
    if not sys.platform.startswith("linux"):
        yield _spawned
        return
    spawn = multiprocessing.get_context("spawn")
    requests, theirs = spawn.Pipe()
    forker = spawn.Process(target=_fork_each, args=(theirs, preload))
    forker.start()
    theirs.close()

    def forked(function: Callable[..., Any], *args: Any) -> Any:
        requests.send_bytes(pickle.dumps((function, args), protocol=5))
        pieces = []
        try:
            while (message := requests.recv_bytes())[:1] == _PIECE:
                pieces.append(message[1:])
        except (EOFError, ConnectionResetError):  # the forker has gone (not any OSError:
            # a TimeoutError raised here by a signal handler is the demo's own, raised on)
            raise RuntimeError(
                f"The demo's forker process ended with exit code {_exit_code(forker)} while "
                "a run was in flight; its runs stop with it."
            ) from None
        return _result(b"".join(pieces), int(message[1:]))

    try:
        yield forked
    except BaseException:
        forker.terminate()  # and with it the run in flight (`_run_forked`)
        raise
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
        reply = receiver.recv_bytes()
    except EOFError:
        reply = b""
    return _result(reply, _exit_code(process))


def _exit_code(process: BaseProcess) -> int:
    process.join()
    return process.exitcode or 0


def _result(reply: bytes, exit_code: int) -> Any:
    if exit_code != 0 or not reply:
        raise RuntimeError(
            f"A demo run's process ended with exit code {exit_code} before reporting (a "
            "negative code is the signal that stopped it: -9 is often the out-of-memory "
            "killer; its own error, if any, is above)."
        )
    error, value = pickle.loads(reply)
    if error is not None:
        raise value from _RemoteTraceback(error)
    return value


class _RemoteTraceback(Exception):
    """The traceback text of an error raised in a run's process."""


def _fork_each(requests: Connection, preload: tuple[str, ...]) -> None:
    """The forker: ``preload`` imported, each request unpickled here (which imports its
    modules once, for every later child too), then run in a forked child whose reply is
    passed on a piece at a time, then its exit code."""
    for name in preload:
        importlib.import_module(name)

    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError, EOFError):
        # Ctrl-C reached the demo's process too, which reports it; the demo's process has
        # gone when its end of the pipe has.
        while True:
            function, args = pickle.loads(requests.recv_bytes())
            readable, writable = os.pipe()
            pid = os.fork()
            if pid == 0:
                requests.close()
                os.close(readable)
                _run_forked(writable, function, args)
            os.close(writable)
            del function, args
            with open(readable, "rb") as reply:
                while piece := reply.read(CHUNK):
                    requests.send_bytes(_PIECE + piece)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            requests.send_bytes(_ENDED + str(code).encode())


def _run_forked(writable: int, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """A forked child: the run, its reply written to ``writable``; never returns."""
    # Killed when the forker goes (it died, or the demo's process stopped it), never left
    # training.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    code = 1
    try:
        with open(writable, "wb") as out:
            out.write(_reply_bytes(function, args))
        code = 0
    except KeyboardInterrupt:
        pass  # Ctrl-C reached the demo's process as well, which reports it
    except BaseException:  # an unpicklable reply, the run's own SystemExit: said, not lost
        traceback.print_exc()
    finally:
        _end_now(code)


def _reply_bytes(function: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    reply: tuple[str | None, Any]
    try:
        reply = (None, function(*args))
    except Exception as error:
        reply = (traceback.format_exc(), error)
    # Plain pickle copies the tensors into the message: multiprocessing's own pickler would
    # share them through file descriptors that vanish when this process exits. Protocol 5
    # (Python 3.8): the "medium" model's weights there and back in 0.19 s, not 0.33 s.
    return pickle.dumps(reply, protocol=5)


def _reply(sender: Connection, function: Callable[..., Any], *args: Any) -> None:
    """A spawned run: its reply sent on ``sender``."""
    try:
        reply = _reply_bytes(function, args)
    except KeyboardInterrupt:
        return  # Ctrl-C reached the main process as well, which reports it
    sender.send_bytes(reply)
    sender.close()
    _end_now(0)


def _end_now(code: int) -> None:
    """A run's process ends, its output flushed, without the interpreter's teardown (0.6 to
    0.8 s with torch loaded, each run, which the parent waited for); multiprocessing ends a
    forked child so too (os._exit). Nothing of a run needs it: the operating system takes
    back its memory, files and devices."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
