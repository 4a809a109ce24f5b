"""Which of mpiexec's ranks ended first, on its own.

When a rank dies under `mpiexec`, hydra's proxy kills the others within milliseconds (rank 0 ended
8 ms after rank 1 on a loaded 2-core machine: benchmarks/results/diagnostics/mpiexec-dead-rank-
2026-12-07.md), and mpiexec reports the first bad exit in *rank* order, which can be a rank it killed;
the supervisor does not see the ranks' exits itself (they are the proxy's children), and a watcher
timing their ends can be starved past that gap (a pidfd watcher named rank 0 in 1 run of 8 under load).
So each rank's shell runs the command as its child and, when the command ends, writes its exit status
to logs/rank-R.exit before it exits itself: before the proxy can see the rank end (the shell holds the
rank's PMI descriptor) and kill the others, whose shells die with them (SIGUSR1, then SIGKILL, to the
process group) and write nothing. The markers are causal: the dead rank's is there first, with the
command's own status. They are also how the supervisor learns that a rank died at all (it reads them every
poll): mpiexec may never end. The shell exits with 128 + N rather than by the signal, so hydra's proxy kills
the others only from the close of the rank's PMI socket, and it skips that when it has reaped the shell
first (woken by its stdout closing: hydra's pmip.c and pmip_cb.c, MPICH 5.0), leaving them in their
collective for the dead rank (CI, 2026-12-07: benchmarks/results/diagnostics/mpiexec-missed-dead-rank-
2026-12-07.md). (The ranks `kiln launch` starts itself need none: it sees each exit, and kiln's
PMI servers leave the others alive for its teardown; kiln.distributed.pmi.)
"""

from __future__ import annotations

from pathlib import Path


class ExitMarkers:
    """The exit statuses mpiexec's ranks' shells write (rank -> logs/rank-R.exit; the launcher removes them
    before each attempt). `ended()`: rank -> (status, time), first to end first by the files' modification
    times (one clock tick apart at worst: ties, rare, in rank order); the status is the shell's $? of the
    command (128 + N for a signal N)."""

    def __init__(self, paths: dict[int, Path]):
        self.paths = dict(paths)

    def ended(self) -> dict[int, tuple[int, float]]:
        found = []
        for rank, path in self.paths.items():
            try:
                status, mtime = int(path.read_text()), path.stat().st_mtime_ns
            except (OSError, ValueError):
                continue  # still running, killed (no marker), or the status half written
            found.append((mtime, rank, status))
        return {rank: (status, mtime / 1e9) for mtime, rank, status in sorted(found)}
