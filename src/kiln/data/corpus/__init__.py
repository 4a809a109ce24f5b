"""The text that ships with kiln, so that `kiln train` trains on real writing with no download."""

import os
import shutil
from pathlib import Path

BUNDLED_TEXT = Path(__file__).with_name("python-reference.txt")


def bundled_text() -> str:
    """The Python Language Reference topics (about 465 KB of English), as one string."""
    return BUNDLED_TEXT.read_text(encoding="utf-8")


def bundled_dataset() -> Path:
    """The bundled corpus as byte-level shards, prepared once into kiln's cache folder."""
    import kiln
    from kiln.data.prepare import prepare
    cache = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))
    digest = f"{kiln.__version__}-{BUNDLED_TEXT.stat().st_size}-{int(BUNDLED_TEXT.stat().st_mtime)}"
    out = cache / f"bundled-bytes-{digest}"
    if not (out / "meta.json").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        prepare([BUNDLED_TEXT], tmp, tokenizer="bytes", val_fraction=0.1, progress=False)
        try:
            tmp.rename(out)
        except OSError:  # another process prepared it first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return out
