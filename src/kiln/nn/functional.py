"""The differentiable functions in one namespace (as torch.nn.functional)."""

from kiln.ops.attention import causal_self_attention, scaled_dot_product_attention
from kiln.ops.convert import to_kept_dtype
from kiln.ops.cross_entropy import cross_entropy
from kiln.ops.dropout import dropout
from kiln.ops.elementwise import where
from kiln.ops.embedding import embedding
from kiln.ops.gelu import gelu
from kiln.ops.layer_norm import add_layer_norm, layer_norm
from kiln.ops.lm_head import lm_head_cross_entropy
from kiln.ops.matmul import gelu_linear, linear, linear_gelu, linear_gelu_linear, matmul, norm_linear
from kiln.ops.softmax import log_softmax, softmax

__all__ = ["causal_self_attention", "scaled_dot_product_attention", "to_kept_dtype", "cross_entropy", "dropout", "where", "embedding", "gelu",
           "add_layer_norm", "layer_norm", "gelu_linear", "linear", "linear_gelu", "linear_gelu_linear", "lm_head_cross_entropy", "matmul", "norm_linear", "log_softmax", "softmax"]
