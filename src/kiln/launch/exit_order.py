"""The order in which a gang's rank processes end.

When one rank dies its peers are killed after it: under `mpiexec` by hydra's proxy within
milliseconds (rank 0 ended 8 ms after rank 1 on a loaded 2-core machine), without it by kiln's PMI
servers within ABORT_POLL_S. mpiexec reports the first bad exit in *rank* order, which can be a rank
it killed rather than the one that died, and the supervisor's 0.1 s poll can see both gone at once.

- `ExitOrder`, for the ranks the supervisor starts itself: a thread waits on a pidfd of each (readable
  the moment it exits) and keeps the order in which they ended, with the time it saw each.
- `ExitMarkers`, for mpiexec's ranks: each rank's shell runs the command as its child and, when the
  command ends, writes its exit status to logs/rank-R.exit before it exits itself, which is before
  hydra's proxy can see the rank end (the shell holds the rank's PMI descriptor) and kill the others:
  their shells die with them (SIGUSR1, then SIGKILL, to the process group) and write nothing. The
  markers are causal: the dead rank's is there first, and its status is the command's own.

Both give `ended()`: rank -> (exit status or None, time), first to end first, and `stop()`.
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path


def process_status(pid: int) -> tuple[bool, int | None]:
    """(alive, status) of a process that need not be our child, from /proc/<pid>/stat: a zombie has
    ended and shows its exit status (negative: the signal that ended it); a missing process has
    ended and its status is gone (its parent reaped it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False, None
    if fields[0] not in ("Z", "X"):
        return True, None
    wait_status = int(fields[49])  # field 52, exit_code: the status waitpid would return
    return False, -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


class ExitOrder:
    """Watches each rank's process (rank -> pid): `ended()` is every rank whose process has ended, first
    to end first, as rank -> (wait status, or None when already reaped; time.time() when seen). Needs
    os.pidfd_open (Linux 5.3)."""

    available = hasattr(os, "pidfd_open")

    def __init__(self, pids: dict[int, int]):
        self.pids = dict(pids)
        self._ended: dict[int, tuple[int | None, float]] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # stop() writes a byte: the watcher's poll returns at once
        self._thread = threading.Thread(target=self._run, name="kiln-exit-order", daemon=True)
        self._thread.start()

    def ended(self) -> dict[int, tuple[int | None, float]]:
        return dict(self._ended)

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller, watched = select.poll(), {}  # pidfd -> (rank, pid)
        poller.register(self._wake_r, select.POLLIN)
        for rank, pid in self.pids.items():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # gone (and reaped) before the watcher started
                self._ended[rank] = None, time.time()
                continue
            poller.register(fd, select.POLLIN)
            watched[fd] = (rank, pid)
        try:
            while watched and not self._stop.is_set():
                ready = [(fd, *watched[fd]) for fd, _ in poller.poll() if fd in watched]
                for fd, rank, pid in sorted(ready, key=lambda r: r[1]):  # ties (one wake-up): rank order
                    self._ended[rank] = process_status(pid)[1], time.time()
                    poller.unregister(fd)
                    os.close(fd)
                    del watched[fd]
        finally:
            for fd in watched:
                os.close(fd)


class ExitMarkers:
    """The exit statuses mpiexec's ranks' shells write (rank -> logs/rank-R.exit; the launcher removes them
    before each attempt): `ended()` as ExitOrder's, ordered by the files' modification times (one clock
    tick apart at worst: ties, rare, in rank order), the status the shell's ($? of the command: 128 + N
    for a signal N)."""

    def __init__(self, paths: dict[int, Path]):
        self.paths = dict(paths)

    def ended(self) -> dict[int, tuple[int | None, float]]:
        found = []
        for rank, path in self.paths.items():
            try:
                status, mtime = int(path.read_text()), path.stat().st_mtime_ns
            except (OSError, ValueError):
                continue  # still running, killed (no marker), or the status half written
            found.append((mtime, rank, status))
        return {rank: (status, mtime / 1e9) for mtime, rank, status in sorted(found)}

    def stop(self) -> None:
        pass
