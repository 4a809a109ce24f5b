"""Work: one collective in flight, and how a process fails a run that a peer has left."""

from __future__ import annotations

import atexit
import sys
import time

from kiln.errors import DistributedError

_aborts: list = []  # engines to abort at exit, after a collective failed (peers must not hang)


def poll(test, deadline: float) -> bool:
    """Call test() until it is true (True) or the deadline passes (False); spin briefly, then sleep."""
    spins = 0
    while not test():
        if time.monotonic() > deadline:
            return False
        spins += 1
        time.sleep(0 if spins < 64 else min(1e-3, 1e-5 * spins))
    return True


def fail(engine, message: str) -> DistributedError:
    """Mark engine broken, arrange for the whole job to be aborted when this process exits
    (MPI_Abort / ncclCommAbort: a peer stuck in a collective with us is torn down rather than
    left to hang), and return the error to raise. The message goes to stderr at once too."""
    engine.broken = True
    if not _aborts:
        atexit.register(_abort_all)
    if engine not in _aborts:
        _aborts.append(engine)
    sys.stderr.write(f"kiln: distributed error: {message}\n")
    sys.stderr.flush()
    return DistributedError(message)


def _abort_all() -> None:
    # The live ranks time out within moments of each other: a short grace lets each report its
    # own error before the first abort tears the job down.
    time.sleep(min(2.0, min(e.timeout for e in _aborts) / 4))
    for engine in _aborts:
        engine.abort()


class Work:
    """A collective in flight. `wait()` makes its result usable by what comes next: on the CPU the
    host waits (up to the group's timeout, then DistributedError); on CUDA kiln's compute stream
    waits on `event` and the host does not. `synchronize()` always blocks the host.

    `keep`: the collective's operands, held until it completes or the compute stream is ordered after
    it. On CUDA it reads and writes them on another stream after the call returns; dropped sooner,
    their blocks would go back to the caching allocator, which hands them to the compute stream at once."""

    def __init__(self, engine, what: str, test, finish=None, event=None, keep=()):
        self.engine, self.what, self.event = engine, what, event
        self._test, self._finish, self._done, self._keep = test, finish, False, keep
        self._started = time.monotonic()

    def is_completed(self) -> bool:
        if not self._done and self._test():
            self._complete()
        return self._done

    def _complete(self) -> None:
        self._done, self._keep = True, ()
        if self._finish is not None:
            self._finish()

    def wait(self) -> None:
        if self._done:
            return
        if self.event is not None:  # CUDA: order the compute stream after it, GPU-side
            self.engine.order_after(self)
            self._complete()
            return
        self.synchronize()

    def synchronize(self) -> None:
        """Block the host until the collective has run; DistributedError after the group's timeout."""
        if self._done and self.event is None:
            return
        engine = self.engine
        if not poll(lambda: self._test() or engine.error() is not None, self._started + engine.timeout):
            raise engine.timed_out(self.what)
        if engine.error() is not None:
            raise fail(engine, f"rank {engine.rank} of {engine.size}: {self.what} failed: {engine.error()}")
        if not self._done:
            self._complete()
