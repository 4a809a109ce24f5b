"""The order in which a gang's rank processes end.

When one rank dies its peers are killed after it: under `mpiexec` by hydra's proxy within
milliseconds, without it by kiln's PMI servers within ABORT_POLL_S. mpiexec then reports the first
bad exit in *rank* order, which can be a rank it killed rather than the one that died (seen on a
loaded 2-core machine: rank 1 SIGKILLed, rank 0 killed by the proxy 8 ms later, mpiexec named
rank 0), and the supervisor's 0.1 s poll can see both gone at once. Here a thread waits on a pidfd
of each rank's process (readable the moment it exits, the supervisor's child or not: under
mpiexec the ranks are the proxy's) and keeps the order in which they ended, each with its wait
status where its zombie still showed it, and the time it was seen.
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
    """Watches each rank's process: `pids` is rank -> its pid, or the file it will write its pid to
    when it starts (mpiexec's ranks). `ended()` is every rank whose process has ended, first to end
    first, as rank -> (wait status, or None when already reaped; time.time() when seen). Needs
    os.pidfd_open (Linux 5.3)."""

    available = hasattr(os, "pidfd_open")

    def __init__(self, pids: dict[int, int | Path]):
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
        try:
            while not self._stop.is_set():
                for rank, source in self.pids.items():
                    if rank in self._ended or rank in {r for r, _ in watched.values()}:
                        continue
                    try:
                        pid = source if isinstance(source, int) else int(source.read_text())
                    except (OSError, ValueError):
                        continue  # not started yet (or the pid half written)
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        self._ended[rank] = None, time.time()
                        continue
                    poller.register(fd, select.POLLIN)
                    watched[fd] = (rank, pid)
                known = len(watched) + len(self._ended) == len(self.pids)
                events = poller.poll(None if known else RESCAN_S * 1000)
                ready = [(fd, *watched[fd]) for fd, _ in events if fd in watched]
                for fd, rank, pid in sorted(ready, key=lambda r: r[1]):  # ties (one wake-up): rank order
                    self._ended[rank] = process_status(pid)[1], time.time()
                    poller.unregister(fd)
                    os.close(fd)
                    del watched[fd]
        finally:
            for fd in watched:
                os.close(fd)
