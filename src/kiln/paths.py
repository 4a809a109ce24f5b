"""Where kiln reads and writes on a user's behalf: a file that a folder's own index names must lie
inside that folder, and an output folder must be a folder (or creatable as one)."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import ConfigError, DataError


def file_inside(folder, name, what: str, error: type = DataError) -> Path:
    """`folder / name`, refused (`error`) unless `name` is a relative path that stays inside `folder`
    (no absolute path, no `..` out of it): an index (meta.json, an HF weight_map) names only its
    own files. Symbolic links the user put in the folder are followed as they are."""
    if not isinstance(name, str) or not name or os.path.isabs(name) \
            or os.path.normpath(name).split(os.sep)[0] in ("..", "."):
        raise error(f"{what} names {name!r}: allowed are only files inside {folder}")
    return Path(folder) / os.path.normpath(name)


def output_folder(path, what: str) -> Path:
    """`path` as a folder to write into: refused when it, or the nearest part of it that exists,
    is not a folder (mkdir would fail half-way with NotADirectoryError or FileExistsError)."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"{what} {str(path)!r}: {str(existing)!r} is a file, not a folder; "
                          "give a folder (it is created if it does not exist)")
    return path
