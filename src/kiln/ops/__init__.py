"""Differentiable ops: each a forward and a backward that call named backend kernels.

Where to find an op: `ops/<family>.py` holds its forward and backward, `backend/cpu/<family>.py`
its reference kernel, `backend/cuda/kernels/<family>.cu` its GPU kernel, `tests/test_op_*.py` (the NN families share `test_op_nn.py`) and `tests/test_cuda_kernels.py`
its tests. The user-facing functions are gathered in `kiln.nn.functional`.
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
