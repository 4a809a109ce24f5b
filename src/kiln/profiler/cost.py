"""What a kernel call costs in FLOPs and bytes, from its arguments' shapes, and a GPT step's FLOPs.

FLOPs are counted for the GEMM and attention families (2 per multiply-add): a causal attention
kernel does T(T+1)/2 of the T^2 score rows' work, and that is what its achieved TFLOP/s is of;
its backward counts twice its forward (dQ, dK, dV: four GEMMs to the forward's two). Bytes are
those a kernel must move: every array argument read plus every array it returns, once. MFU uses
the model-FLOP convention of PaLM (Appendix B) and nanoGPT: 6 per parameter of the GEMMs per
token plus attention's 12 * n_layer * T * n_embd, full (not causal) scores.
"""

from __future__ import annotations

FAMILIES = {  # backend kernel -> the kernel family (DESIGN.md) its time is reported under
    "matmul": "matmul", "linear_fwd": "matmul", "linear_bwd": "matmul", "linear_gelu_fwd": "matmul",
    "linear_gelu_bwd": "matmul",
    "embedding_fwd": "embedding", "embedding_bwd": "embedding", "scatter_add": "embedding",
    "layer_norm_fwd": "layer_norm", "layer_norm_bwd": "layer_norm", "add_layer_norm_fwd": "layer_norm",
    "add_layer_norm_bwd": "layer_norm", "gelu_fwd": "gelu", "gelu_bwd": "gelu", "gelu_bwd_bias": "gelu",
    "softmax_fwd": "softmax",
    "softmax_bwd": "softmax", "log_softmax_fwd": "softmax", "log_softmax_bwd": "softmax",
    "cross_entropy_fwd": "cross_entropy", "cross_entropy_bwd": "cross_entropy",
    "lm_head_xent_fwd": "lm_head", "lm_head_xent_bwd": "lm_head", "attention_fwd": "attention",
    "attention_bwd": "attention", "dropout_fwd": "dropout", "adamw_step": "adamw", "grad_norm": "adamw",
    "scale_": "adamw", "add": "elementwise", "cast": "elementwise",
}


def _arrays(obj):
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _arrays(o)
    elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):
        yield obj


def _attention_flops(q) -> int:
    b, h, t, d = q.shape
    return 2 * 2 * b * h * d * (t * (t + 1) // 2)  # QK^T and PV over the causal triangle


def kernel_flops(name: str, args, out) -> int:
    """Floating-point operations of one backend kernel call (0 outside the GEMM/attention families)."""
    if name in ("linear_fwd", "linear_gelu_fwd"):
        x, w = args[0], args[1]
        return 2 * x.shape[0] * x.shape[1] * w.shape[0]
    if name == "linear_bwd":
        g, x, w, need_dx, need_dw = args[:5]
        k = x.shape[1] if x is not None else w.shape[1]
        return 2 * g.shape[0] * g.shape[1] * k * (bool(need_dx) + bool(need_dw))
    if name == "linear_gelu_bwd":  # grad [N, out] @ weight [out, in]
        g, w = args[0], args[2]
        return 2 * g.shape[0] * g.shape[1] * w.shape[1]
    if name == "lm_head_xent_fwd":  # the logits GEMM, then dx's and dweight's (made in the forward)
        x, w = args[0], args[1]
        need_dx, need_dw = (tuple(args[5:7]) + (True, True))[:2]
        return 2 * x.shape[0] * x.shape[1] * w.shape[0] * (1 + bool(need_dx) + bool(need_dw))
    if name == "matmul":
        a = args[0]
        n = 1
        for s in out.shape:
            n *= s
        return 2 * n * a.shape[-1]
    if name == "attention_fwd":
        return _attention_flops(args[0])
    if name == "attention_bwd":
        return 2 * _attention_flops(args[1])
    return 0


def kernel_bytes(args, out) -> int:
    """Bytes read (every array argument) plus bytes written (every array returned), once each."""
    seen, total = set(), 0
    for a in list(_arrays(args)) + list(_arrays(out)):
        if id(a) not in seen:
            seen.add(id(a))
            total += int(a.nbytes)
    return total


def gpt_flops_per_token(cfg, seq_len: int) -> int:
    """Model FLOPs of one training token (forward and backward) of kiln's GPT: 6 per GEMM weight
    (the blocks' 12 * n_embd^2 and the LM head's n_embd * vocab_size; embeddings gather, they do
    not multiply) plus 12 * n_layer * seq_len * n_embd for the attention scores and their use."""
    d, L = cfg.n_embd, cfg.n_layer
    gemm_params = L * 12 * d * d + d * cfg.vocab_size
    return 6 * gemm_params + 12 * L * seq_len * d


def mfu(tokens_per_s: float, flops_per_token: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model FLOPs a run achieved per second over the device's peak."""
    return tokens_per_s * flops_per_token / peak_flops
