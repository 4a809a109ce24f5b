"""Where a rank script writes its result for tests/mpi_runner.py."""

import json
import os
from pathlib import Path


def write_result(rank: int, result) -> None:
    Path(os.environ["KILN_RANK_OUT"], f"rank{rank}.json").write_text(json.dumps(result))
