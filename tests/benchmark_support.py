"""Load a benchmark program (benchmarks/<name>.py) as a module, as its tests do to check its arithmetic."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module. The benchmarks import their shared pieces (result_file.py,
    kernel_speed.py) by name, so their folder goes on sys.path: last, so that no benchmark's name can
    hide an installed package from the rest of the test session (a benchmarks/kernels.py once made
    transformers take it for the Hugging Face `kernels` package)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
