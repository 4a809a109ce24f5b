"""A run's checkpoints folder: step-numbered files, the last K kept, `latest.json` naming the newest
good one; resume falls back to the previous good file when the newest is corrupt.

    runs/r/checkpoints/ckpt-00000200.kiln
    runs/r/checkpoints/ckpt-00000300.kiln
    runs/r/checkpoints/latest.json        {"file": "ckpt-00000300.kiln", "step": 300, ...}

The pointer moves only after a file is completely written, fsync'd and renamed, and older files
are pruned only after that, so the previous good checkpoint is never lost (even with K = 1, the
old file goes only once the new one is in place).
"""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

from kiln.checkpoint.format import SUFFIX, CheckpointError, atomic_file, load

POINTER = "latest.json"
_NAME = re.compile(r"^ckpt-(\d{8,})" + re.escape(SUFFIX) + "$")


class CheckpointFolder:
    """The checkpoints of one run, in `folder` (created on first save)."""

    def __init__(self, folder, keep: int = 3):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise CheckpointError(f"keep_checkpoints must be an integer >= 1, got {keep!r}")
        self.folder = Path(folder)
        self.keep = keep
        self._lock = threading.Lock()

    def path_for(self, step: int) -> Path:
        return self.folder / f"ckpt-{step:08d}{SUFFIX}"

    def prepare(self) -> None:
        """Create the folder and remove temporary files that a crashed save left behind."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for tmp in self.folder.glob(".ckpt-*.tmp-*"):
            tmp.unlink(missing_ok=True)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file here, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def pointer(self) -> dict | None:
        """latest.json's content, or None when there is none (or it is unreadable)."""
        try:
            return json.loads((self.folder / POINTER).read_text())
        except (OSError, ValueError):
            return None

    def commit(self, result: dict) -> None:
        """After `save` wrote result["path"] completely: point latest.json at it, then prune."""
        path = Path(result["path"])
        m = _NAME.match(path.name)
        if path.parent != self.folder or not m:
            raise CheckpointError(f"{path} is not a checkpoint of {self.folder}")
        with self._lock:
            with atomic_file(self.folder / POINTER) as f:
                f.write(json.dumps({"file": path.name, "step": int(m.group(1)),
                                    "checksum": result.get("checksum"), "bytes": result.get("bytes")},
                                   indent=1).encode())
            self.prune(protect=path)

    def prune(self, protect: Path | None = None) -> None:
        """Delete all but the newest `keep` checkpoints (never `protect`, never the pointer's)."""
        pointed = (self.pointer() or {}).get("file")
        files = self.checkpoints()
        for _, p in files[:max(0, len(files) - self.keep)]:
            if p != protect and p.name != pointed:
                p.unlink(missing_ok=True)

    def candidates(self) -> list[Path]:
        """Checkpoints to resume from, best first: the pointer's, then the others newest first."""
        files = [p for _, p in reversed(self.checkpoints())]
        pointed = (self.pointer() or {}).get("file")
        first = [p for p in files if p.name == pointed]
        return first + [p for p in files if p.name != pointed]

    def load_latest(self, report=None) -> tuple[dict, Path]:
        """(state, path) of the newest checkpoint that loads and verifies. Each corrupt one is
        reported (report(message), default: stderr) and skipped; none good is a CheckpointError."""
        report = report or (lambda msg: print(f"kiln: warning: {msg}", file=sys.stderr, flush=True))
        failures = []
        for path in self.candidates():
            try:
                state = load(path)
            except CheckpointError as e:
                failures.append(f"{path.name}: {e}")
                report(f"{e}; trying the previous checkpoint")
                continue
            if failures:
                report(f"resuming from {path}, the newest good checkpoint")
            return state, path
        if not failures:
            raise CheckpointError(f"{self.folder} holds no checkpoints (ckpt-NNNNNNNN{SUFFIX}); "
                                  "nothing to resume from")
        raise CheckpointError(f"no good checkpoint in {self.folder}: " + "; ".join(failures))
