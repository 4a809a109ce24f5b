"""The reference side: kiln's GPT written op by op with PyTorch, unfused, each op output tapped
under the name `capture.reference_name` gives kiln's fused op. PyTorch is imported here only.

Precisions follow kiln's (train.apply_precision): fp64 and fp32 are the parameters' dtype; tf32
is fp32 with TF32 tensor-core matmuls; bf16 is torch.autocast's policy written out (on every device
alike, whatever kiln's bf16_residual): the residual stream, the LayerNorms (fp32 weights) and the loss
in fp32, the GEMMs, attention and GELU in bf16, a LayerNorm's output rounded to bf16 where a GEMM
reads it. A kiln run with a bf16 residual shows there as bfloat16 against float32 (ref_dtype).
"""

from __future__ import annotations

import math

from kiln.errors import NotBuiltError

PRECISIONS = ("fp64", "fp32", "tf32", "bf16")


def import_torch():
    """torch, or a NotBuiltError saying how to get it (it is a test/benchmark dependency only)."""
    try:
        import torch
    except ImportError as e:
        raise NotBuiltError("the precision logger compares against PyTorch, which is not installed here; "
                            "install it with `pip install torch` (or kiln's [test] extra)") from e
    return torch


class TorchGPT:
    """Parameters (fp64 for fp64, else fp32 leaves requiring grad) from a kiln state_dict of numpy
    arrays, and a forward that records each op output in `taps` (retaining its gradient)."""

    def __init__(self, state: dict, config, precision: str, device: str = "cpu"):
        torch = import_torch()
        self.torch, self.config, self.precision = torch, config, precision
        master = torch.float64 if precision == "fp64" else torch.float32
        self.params = {name: torch.tensor(arr, dtype=master, device=device).requires_grad_()
                       for name, arr in state.items()}
        self.compute = torch.bfloat16 if precision == "bf16" else master
        self.device = device
        self.taps: dict = {}

    def _tap(self, name, t):
        if t.requires_grad:
            t.retain_grad()
        self.taps[name] = t
        return t

    def _w(self, name):
        """A GEMM's weight or bias in the compute dtype."""
        p = self.params.get(name)
        return None if p is None else p.to(self.compute)

    def _ln(self, x, name):
        """The LayerNorm `name` of x in x's dtype with the master weights (autocast's fp32 LayerNorm)."""
        return self.torch.nn.functional.layer_norm(x, (x.shape[-1],), self.params[name + ".weight"],
                                                   self.params.get(name + ".bias"), 1e-5)

    def forward(self, idx, targets):
        """(logits, loss) for int64 torch tensors idx, targets [B, T]; fills self.taps."""
        torch = self.torch
        F = torch.nn.functional
        cfg, tap, w = self.config, self._tap, self._w
        torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = self.precision == "tf32"
        self.taps = {}
        b, t = idx.shape
        h, c = cfg.n_head, cfg.n_embd
        pos = torch.arange(t, device=idx.device)
        x = tap("embed", tap("wte", F.embedding(idx, self.params["wte.weight"]))
                + tap("wpe", F.embedding(pos, self.params["wpe.weight"])))
        lo = self.compute
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            a = tap(p + "ln_1", self._ln(x, p + "ln_1"))
            qkv = tap(p + "attn.c_attn", F.linear(a.to(lo), w(p + "attn.c_attn.weight"), w(p + "attn.c_attn.bias")))
            q, k, v = qkv.view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c // h))
            y = tap(p + "attn.sdpa", y.transpose(1, 2).reshape(b, t, c))
            y = tap(p + "attn.c_proj", F.linear(y, w(p + "attn.c_proj.weight"), w(p + "attn.c_proj.bias")))
            x = tap(p + "attn.residual", x + y)  # bf16 + fp32 promotes to fp32, as under autocast
            m = tap(p + "ln_2", self._ln(x, p + "ln_2"))
            m = tap(p + "mlp.c_fc", F.linear(m.to(lo), w(p + "mlp.c_fc.weight"), w(p + "mlp.c_fc.bias")))
            m = tap(p + "mlp.gelu", F.gelu(m, approximate="tanh"))
            m = tap(p + "mlp.c_proj", F.linear(m, w(p + "mlp.c_proj.weight"), w(p + "mlp.c_proj.bias")))
            x = tap(p + "mlp.residual", x + m)
        x = tap("ln_f", self._ln(x, "ln_f"))
        logits = tap("lm_head", F.linear(x.to(lo), w("wte.weight" if cfg.tie_weights else "lm_head.weight")))
        flat = (logits.float() if self.precision == "bf16" else logits).view(-1, logits.size(-1))
        loss = tap("loss", F.cross_entropy(flat, targets.view(-1)))
        return logits, loss
