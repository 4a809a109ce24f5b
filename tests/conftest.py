"""Test-wide settings: a private cache for prepared data, so a test run never reads stale shards."""

import os
import tempfile

os.environ.setdefault("KILN_CACHE", tempfile.mkdtemp(prefix="kiln-cache-"))
