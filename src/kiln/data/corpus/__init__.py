"""The text that ships with kiln, so that `kiln train` trains on real writing with no download."""

from pathlib import Path

BUNDLED_TEXT = Path(__file__).with_name("python-reference.txt")


def bundled_text() -> str:
    """The Python Language Reference topics (about 465 KB of English), as one string."""
    return BUNDLED_TEXT.read_text(encoding="utf-8")
