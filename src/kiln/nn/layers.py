"""The layers a GPT is made of: Linear, Embedding, LayerNorm, GELU, Dropout.

Weights start as GPT-2 starts them: normal with std 0.02 (or the `std` given), biases at zero.
Weights follow the activations' dtype: with fp32 master weights and bf16 activations, a layer
uses a bf16 copy of its weights (a cast op, so the gradient flows back to the fp32 weight). The
copy is kept with the parameter and AdamW writes it with each update, so a step casts no weight.
"""

from __future__ import annotations

from kiln.nn import functional as F
from kiln.nn.module import Module, Parameter
from kiln.random import default_generator, randn
from kiln.tensor import ones, zeros


def as_dtype_of(weight, x):
    """weight in x's floating dtype (itself when it already is; None stays None); a Parameter's
    from the copy it keeps (recast only when the parameter changed since: AdamW keeps it current)."""
    if weight is None or weight.dtype is x.dtype:
        return weight
    if isinstance(weight, Parameter):
        return F.to_kept_dtype(weight, weight.kept_copy(x.dtype))
    return weight.to(x.dtype)


def _normal(shape, std, generator):
    return Parameter(randn(*shape, generator=generator or default_generator("cpu")) * std)


class Linear(Module):
    """y = x @ weight^T + bias, weight of shape [out_features, in_features] as in PyTorch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02,
                 generator=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _normal((out_features, in_features), std, generator)
        self.bias = Parameter(zeros(out_features)) if bias else None

    def forward(self, x):
        return F.linear(x, as_dtype_of(self.weight, x), as_dtype_of(self.bias, x))

    def forward_gelu(self, x):
        """gelu(self(x)); with a bias one op (F.linear_gelu: on the GPU in bf16 the GELU is the GEMM's epilogue)."""
        if self.bias is None:
            return F.gelu(self.forward(x))
        return F.linear_gelu(x, as_dtype_of(self.weight, x), as_dtype_of(self.bias, x))


    def forward_of_norm(self, x, s, norm):
        """self(x) for x = norm(s) (a LayerNorm), keeping s, not x, for the backward (F.norm_linear: it makes x again)."""
        return F.norm_linear(x, as_dtype_of(self.weight, x), as_dtype_of(self.bias, x), s,
                             as_dtype_of(norm.weight, s), as_dtype_of(norm.bias, s), norm.eps)

    def forward_of_gelu(self, pre):
        """self(gelu(pre)) keeping pre, not gelu(pre), for the backward (F.gelu_linear: it makes gelu(pre) again)."""
        return F.gelu_linear(pre, as_dtype_of(self.weight, pre), as_dtype_of(self.bias, pre))


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 0.02, generator=None):
        super().__init__()
        self.weight = _normal((num_embeddings, embedding_dim), std, generator)

    def forward(self, idx):
        return F.embedding(idx, self.weight)


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(ones(dim))
        self.bias = Parameter(zeros(dim)) if bias else None

    def forward(self, x, out_dtype=None):
        """The LayerNorm of x in x's dtype, its output in out_dtype (default x's)."""
        return F.layer_norm(x, as_dtype_of(self.weight, x), as_dtype_of(self.bias, x), self.eps, out_dtype)

    def add_forward(self, x, y):
        """(x + y, self(x + y)) in one op (F.add_layer_norm): a residual add and this LayerNorm, the
        sum in x's dtype, the LayerNorm's output in y's (a bf16 branch on an fp32 residual)."""
        return F.add_layer_norm(x, y, as_dtype_of(self.weight, x), as_dtype_of(self.bias, x), self.eps)


class GELU(Module):
    def forward(self, x):
        return F.gelu(x)


class Dropout(Module):
    def __init__(self, p: float = 0.0, generator=None):
        super().__init__()
        self.p = p
        self.generator = generator

    def forward(self, x):
        return F.dropout(x, self.p, self.training, self.generator)
