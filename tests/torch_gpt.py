"""A GPT-2 written with PyTorch primitives, the peer that kiln's GPT is checked against.

It takes kiln's state_dict names and layouts (weights [out, in], as torch.nn.Linear), so the
same numbers can be loaded into both.
"""

import math

import torch
import torch.nn.functional as F


def torch_params(model, dtype=torch.float64):
    """kiln model parameters as torch leaf tensors of the same names, requiring grad."""
    return {name: torch.tensor(p.numpy(), dtype=dtype, requires_grad=True)
            for name, p in model.named_parameters()}


def torch_gpt_forward(params, cfg, idx, targets, residual_dtype=None):
    """(logits, loss) of kiln's GPT with parameters `params`, in PyTorch. residual_dtype: the residual
    stream cast to it after the embeddings (torch.bfloat16 under autocast: every add stays bf16); None:
    the parameters' dtype (under autocast, a bf16 branch output added to it promotes to it)."""
    b, t = idx.shape
    x = F.embedding(idx, params["wte.weight"]) + F.embedding(torch.arange(t, device=idx.device), params["wpe.weight"])
    if residual_dtype is not None:
        x = x.to(residual_dtype)
    h, c = cfg.n_head, cfg.n_embd
    for i in range(cfg.n_layer):
        p = lambda n: params.get(f"h.{i}.{n}")  # noqa: E731
        a = F.layer_norm(x, (c,), p("ln_1.weight"), p("ln_1.bias"), 1e-5)
        qkv = F.linear(a, p("attn.c_attn.weight"), p("attn.c_attn.bias"))
        q, k, v = qkv.view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c // h))
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + F.linear(y, p("attn.c_proj.weight"), p("attn.c_proj.bias"))
        m = F.layer_norm(x, (c,), p("ln_2.weight"), p("ln_2.bias"), 1e-5)
        m = F.gelu(F.linear(m, p("mlp.c_fc.weight"), p("mlp.c_fc.bias")), approximate="tanh")
        x = x + F.linear(m, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"))
    x = F.layer_norm(x, (c,), params["ln_f.weight"], params.get("ln_f.bias"), 1e-5)
    head = params["wte.weight"] if cfg.tie_weights else params["lm_head.weight"]
    logits = F.linear(x, head)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    return logits, loss
