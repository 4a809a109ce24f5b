"""Block recomputation (activation checkpointing of whole blocks): a block's forward keeps only its
inputs, and its backward runs the forward again, with grad, to get the activations it needs.

A GPT block in fp32 at B2 T1024 d3072 keeps 384 MiB for its backward (16 [B, T, d] tensors: the
residual and normed inputs of both sublayers, q/k/v, the attention output, the MLP's pre-activation
and GELU output); recomputed, it keeps its two inputs (x and ln_1(x), 48 MiB) and costs one more
forward of the block (2 of its 6 FLOPs a parameter a token). The gradients are the plain graph's bit
for bit: the same ops run on the same inputs in the same order.
"""

from __future__ import annotations

from kiln.autograd import Function, backward_outputs, enable_grad, no_grad


class RecomputedBlock(Function):
    """(x', h') = block(x, h, next_ln), keeping x and h only; the parameters get their gradients
    from the recomputed forward's own backward (their hooks fire there, as in the plain graph)."""

    materialize_grads = False  # the last block's x' is not used: its gradient comes as None

    @staticmethod
    def forward(ctx, x, h, block, next_ln):
        ctx.save_for_backward(x, h)
        ctx.call = (block, next_ln, x.device)
        with no_grad():
            x_out, h_out = block(x, h, next_ln)
        return x_out.data, h_out.data

    @staticmethod
    def backward(ctx, dx_out, dh_out):
        from kiln.tensor import Tensor
        block, next_ln, device = ctx.call
        x, h = (None if a is None else Tensor._wrap(a, device, requires_grad=True) for a in ctx.saved)
        with enable_grad():
            x_out, h_out = block(x, h, next_ln)
        backward_outputs((x_out, h_out), (dx_out, dh_out))
        dx = None if x.grad is None else x.grad.data
        return dx if h is None else (dx, None if h.grad is None else h.grad.data)

