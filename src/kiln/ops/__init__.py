"""Differentiable ops: each a forward and a backward that call named backend kernels.

Where to find an op: `ops/<family>.py` holds its forward and backward, `backend/cpu/<family>.py`
its reference kernel, `backend/cuda/kernels/<family>.cu` its GPU kernel, `tests/test_op_<family>.py`
its tests (the CPU checks and, marked `cuda`, the kernels against the CPU backend). The user-facing functions are gathered in `kiln.nn.functional`.
"""

from kiln.ops import (  # noqa: F401
                      attention,
                      convert,
                      cross_entropy,
                      dropout,
                      elementwise,
                      embedding,
                      gelu,
                      layer_norm,
                      matmul,
                      reduce,
                      shape,
                      softmax,
)
