"""The order in which a gang's rank processes end, for ranks the supervisor did not start itself.

Under `mpiexec` the ranks are children of hydra's proxy, not of the supervisor, and when one rank
dies the proxy kills the others within milliseconds; mpiexec then reports the first bad exit in
*rank* order, which can be a rank it killed rather than the one that died (seen on a loaded
2-core machine: rank 1 SIGKILLed, rank 0 killed by the proxy 8 ms later, mpiexec named rank 0).
The supervisor's 0.1 s poll cannot tell the two apart either. Here a thread waits on a pidfd of
each rank's process (readable the moment it exits, child or not) and keeps the order in which
they ended, each with its wait status when its zombie still showed it and the time it was seen.
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

RESCAN_S = 0.01  # how often the pid files are read until every rank's process is known


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
    """Watches the processes whose pids the ranks leave in `pid_files` (rank -> path; a rank's file
    appears when it starts). `ended()` is every rank whose process has ended, first to end first,
    as rank -> (wait status or None when already reaped, time.time() when seen). Needs
    os.pidfd_open (Linux 5.3)."""

    available = hasattr(os, "pidfd_open")

    def __init__(self, pid_files: dict[int, Path]):
        self.pid_files = dict(pid_files)
        self._ended: dict[int, tuple[int | None, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-exit-order", daemon=True)
        self._thread.start()

    def ended(self) -> dict[int, tuple[int | None, float]]:
        return dict(self._ended)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        poller, watched = select.poll(), {}  # pidfd -> (rank, pid)
        try:
            while not self._stop.is_set():
                for rank, path in self.pid_files.items():
                    if rank in self._ended or rank in {r for r, _ in watched.values()}:
                        continue
                    try:
                        pid = int(path.read_text())
                    except (OSError, ValueError):
                        continue  # not started yet (or the pid half written)
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        self._ended[rank] = None, time.time()
                        continue
                    poller.register(fd, select.POLLIN)
                    watched[fd] = (rank, pid)
                known = len(watched) + len(self._ended) == len(self.pid_files)
                ready = [(fd, *watched[fd]) for fd, _ in poller.poll(100 if known else RESCAN_S * 1000)]
                for fd, rank, pid in sorted(ready, key=lambda r: r[1]):  # ties (one wake-up): rank order
                    self._ended[rank] = process_status(pid)[1], time.time()
                    poller.unregister(fd)
                    os.close(fd)
                    del watched[fd]
        finally:
            for fd in watched:
                os.close(fd)
