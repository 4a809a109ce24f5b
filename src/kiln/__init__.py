"""kiln: a deep-learning training framework built from first principles.

Its own Tensor and reverse-mode autograd, its own kernels (NumPy reference on the CPU, CUDA
on the GPU), modules, AdamW and one training loop shared by the CLI and the Python API.
"""

__version__ = "0.1.0"

from kiln.autograd import enable_grad, is_grad_enabled, no_grad
from kiln.backend import Device, cuda_is_available, device
from kiln.dtypes import DType, bfloat16, bool_, float16, float32, float64, get_dtype, int32, int64, uint16
from kiln.errors import KilnError
from kiln.ops.shape import cat, split
from kiln.random import Generator, manual_seed, rand, randn
from kiln.tensor import Tensor, arange, full, ones, ones_like, tensor, zeros, zeros_like

__all__ = [
    "__version__", "enable_grad", "is_grad_enabled", "no_grad", "Device", "cuda_is_available",
    "device", "DType", "bfloat16", "bool_", "float16", "float32", "float64", "get_dtype", "int32",
    "int64", "uint16", "KilnError", "Generator", "manual_seed", "rand", "randn", "Tensor",
    "arange", "full", "ones", "ones_like", "tensor", "zeros", "zeros_like", "cat", "split",
]
