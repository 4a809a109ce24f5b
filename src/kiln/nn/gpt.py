"""GPT-2: a decoder-only transformer of pre-norm blocks, as in nanoGPT and the paper's Figure 2."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from kiln.autograd import is_grad_enabled, no_grad
from kiln.errors import ConfigError, NotBuiltError
from kiln.nn import functional as F
from kiln.nn.layers import Dropout, Embedding, LayerNorm, Linear, as_dtype_of
from kiln.nn.module import Module, ModuleList
from kiln.nn.recompute import RecomputedBlock
from kiln.tensor import Tensor, arange


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128       # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self):
        # each field is checked against its declared type: bools take true/false only, ints reject
        # bools (True is an int to Python) and floats, floats take ints
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"model.{f.name} must be true or false, got {value!r}")
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"model.{f.name} must be a positive integer, got {value!r}")
            if f.type == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ConfigError(f"model.{f.name} must be a number, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd ({self.n_embd}) must be a multiple of model.n_head "
                              f"({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_dict(cls, settings: dict) -> "GPTConfig":
        """A config from stored settings (a run's config.json); an unknown key is a ConfigError."""
        _check_names(settings)
        return cls(**settings)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of GPT(self)'s parameters, without allocating them: weights on disk are
        checked against it before a model of this config is built."""
        n = self.n_embd
        shapes = {"wte.weight": (self.vocab_size, n), "wpe.weight": (self.block_size, n)}
        linears = (("attn.c_attn", 3 * n, n), ("attn.c_proj", n, n), ("mlp.c_fc", 4 * n, n), ("mlp.c_proj", n, 4 * n))
        for i in range(self.n_layer):
            for ln in ("ln_1", "ln_2"):
                shapes[f"h.{i}.{ln}.weight"] = (n,)
                shapes.update({f"h.{i}.{ln}.bias": (n,)} if self.bias else {})
            for name, out, inp in linears:
                shapes[f"h.{i}.{name}.weight"] = (out, inp)
                shapes.update({f"h.{i}.{name}.bias": (out,)} if self.bias else {})
        shapes["ln_f.weight"] = (n,)
        shapes.update({"ln_f.bias": (n,)} if self.bias else {})
        shapes.update({} if self.tie_weights else {"lm_head.weight": (self.vocab_size, n)})
        return shapes


def _check_names(settings) -> None:
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    bad = [k for k in settings if k not in fields]
    if bad:
        raise ConfigError(f"unknown model settings {bad}; allowed: {sorted(fields)}")


PRESETS = {
    # The CPU default: trains on the bundled corpus (bytes) in about two minutes on two cores. A context
    # of 64 bytes learns words faster per second than 128 (half the tokens a step, the same loss per step
    # early on): 1.97 after 88 s against 128's 2.36 after 105 s (benchmarks/results/kiln_train/).
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
    # The paper's Table 1: GPT-2 124M, vocabulary 50257 padded to 50304.
    "gpt2-124m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # The paper's Table 5: 2.42B parameters, head dim 128.
    "gpt2-2.4b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=20, n_head=24, n_embd=3072),
    # The largest fp32 AdamW model on one H200 (§6.5's experiment there): Table 5's width, 92 layers, 10.58B
    # parameters; PyTorch stops at 76 (8.77B). Trained with AdamW in backward (train.config.RECIPES).
    "gpt2-largest": GPTConfig(vocab_size=50304, block_size=1024, n_layer=92, n_head=24, n_embd=3072),
}


def preset(name: str, **overrides) -> GPTConfig:
    """A copy of a preset's config, with fields overridden."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}")
    _check_names(overrides)
    return dataclasses.replace(PRESETS[name], **overrides)


class CausalSelfAttention(Module):
    def __init__(self, cfg: GPTConfig, generator=None):
        super().__init__()
        self.n_head = cfg.n_head
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, generator=generator)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=resid_std, generator=generator)
        self.resid_dropout = Dropout(cfg.dropout)
        # The attention over a sharded sequence (kiln.distributed.context_parallel, §4.3), set by
        # the parallel strategy; None: this rank holds the whole sequence.
        self.context = None

    def forward(self, x, norm=None):
        """norm: (s, ln) with x = ln(s): c_attn keeps s, not x, for its backward (Block.recompute_norm_gelu)."""
        # q, k, v stay packed in c_attn's [B, T, 3C] output: the attention kernels read them (and
        # write their gradients) in place, and return [B, T, C] with the heads side by side
        qkv = self.c_attn(x) if norm is None else self.c_attn.forward_of_norm(x, *norm)
        if self.context is None:
            y = F.causal_self_attention(qkv, self.n_head)
        else:
            y = self.context(qkv, self.n_head)
        return self.resid_dropout(self.c_proj(y))


class MLP(Module):
    def __init__(self, cfg: GPTConfig, generator=None):
        super().__init__()
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias, generator=generator)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=resid_std, generator=generator)
        self.dropout = Dropout(cfg.dropout)
        # True: c_fc, the GELU and c_proj are one op (F.linear_gelu_linear: the GELU's backward rides in the
        # epilogue of the GEMM that makes its gradient) where both layers are kiln's Linear and c_fc has a bias;
        # False: the ops of c_fc.forward_gelu and c_proj (what the precision logger compares, op by op)
        self.fused = True

    def forward(self, x, norm=None):
        """norm: (s, ln) with x = ln(s): keep s and the pre-activation only, and make x and the GELU
        again in backward (Block.recompute_norm_gelu); None: keep x, the pre-activation and the GELU."""
        if norm is not None:
            return self.dropout(self.c_proj.forward_of_gelu(self.c_fc.forward_of_norm(x, *norm)))
        fc, proj = self.c_fc, self.c_proj
        if self.fused and type(fc) is Linear and type(proj) is Linear and fc.bias is not None:
            return self.dropout(F.linear_gelu_linear(x, as_dtype_of(fc.weight, x), as_dtype_of(fc.bias, x),
                                                     as_dtype_of(proj.weight, x), as_dtype_of(proj.bias, x)))
        return self.dropout(proj(fc.forward_gelu(x)))


class Block(Module):
    def __init__(self, cfg: GPTConfig, generator=None):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, generator)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg, generator)
        # True: the LayerNorm outputs (c_attn's and c_fc's inputs) and the GELU output are made again in
        # backward from what the block keeps anyway (the residual, the pre-activation): 10 of its 16
        # saved [B, T, C] arrays, for a LayerNorm forward of two rows and a GELU (GPT.recompute_norm_gelu)
        self.recompute_norm_gelu = False

    def forward(self, x, h=None, next_ln=None):
        """x + attn(ln_1(x)), then + mlp(ln_2(.)): block(x) alone returns the new residual stream.

        Each residual add is one op with the LayerNorm that follows it (F.add_layer_norm): h is
        ln_1(x) when the caller has it (the previous block's last add made it), and with next_ln
        (the next block's ln_1, or the model's ln_f) the block returns (x', next_ln(x'))."""
        if h is None:
            h = self.ln_1(x)
        short = self.recompute_norm_gelu
        x, h = self.ln_2.add_forward(x, self.attn(h, (x, self.ln_1) if short else None))
        m = self.mlp(h, (x, self.ln_2) if short else None)
        if next_ln is None:
            return x + m
        return next_ln.add_forward(x, m)


class GPT(Module):
    """Token and position embeddings, n_layer Blocks, a final LayerNorm and the LM head."""

    def __init__(self, cfg: GPTConfig, generator=None):
        super().__init__()
        self.config = cfg
        self.compute_dtype = None  # e.g. kiln.bfloat16: activations in bf16 over fp32 weights
        # The residual stream's dtype under a compute_dtype: None keeps it in compute_dtype; kiln.float32 is
        # autocast's policy (an fp32 residual, fp32 LayerNorms whose outputs are rounded for the GEMMs).
        self.residual_dtype = None
        # With targets, the LM head and the loss are one chunked op (F.lm_head_cross_entropy) and
        # forward returns no logits; False makes the [B, T, V] logits whole and returns them too.
        self.fused_lm_head = True
        # The first recompute_blocks blocks keep only their inputs for backward and run their forward
        # again there (kiln.nn.recompute): 48 of 384 MiB a block at d=3072 B2 T1024 fp32, one more forward.
        self.recompute_blocks = 0
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, generator=generator)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, generator=generator)
        self.drop = Dropout(cfg.dropout)
        self.h = ModuleList(Block(cfg, generator) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, bias=cfg.bias)
        if not cfg.tie_weights:
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False, generator=generator)
        # The LM head and loss over a vocabulary sharded across tensor-parallel ranks
        # (kiln.distributed.tensor_parallel, §4.2), set by the parallel strategy; None: dense.
        self.vocab_parallel = None

    @property
    def recompute_norm_gelu(self) -> bool:
        """Whether every block makes its LayerNorm and GELU outputs again in backward instead of keeping
        them (Block.recompute_norm_gelu: 10 of a block's 16 saved [B, T, C] arrays; a few row passes more)."""
        return all(block.recompute_norm_gelu for block in self.h)

    @recompute_norm_gelu.setter
    def recompute_norm_gelu(self, value: bool) -> None:
        for block in self.h:
            block.recompute_norm_gelu = bool(value)

    def forward(self, idx: Tensor, targets: Tensor | None = None, pos: Tensor | None = None):
        """(logits [B, T, V], loss or None) for token ids idx [B, T]; with targets and the fused LM
        head (the default), (None, loss): the logits are never made whole. pos: their positions (default
        0..T-1; a context-parallel rank holds other positions, kiln.distributed.context_parallel)."""
        b, t = idx.shape
        if t > self.config.block_size:
            raise ConfigError(f"sequence of length {t} is longer than the model's context "
                              f"({self.config.block_size})")
        if pos is None:
            pos = arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        residual = self.residual_dtype or self.compute_dtype
        if residual is not None and x.dtype is not residual:
            x = x.to(residual)
        x = self.drop(x)
        # The residual stream x goes from block to block with h, its LayerNorm for the next
        # sublayer; the last block's add is fused with ln_f (its sum is not used: no gradient).
        blocks = list(self.h)
        recompute = self.recompute_blocks if is_grad_enabled() and x.requires_grad else 0
        if recompute and self.training and self.config.dropout > 0:
            raise NotBuiltError(f"recompute_blocks {recompute} with dropout {self.config.dropout}: the recomputed "
                                "forward would draw other masks (replaying the random stream is not built)")
        h = None
        if self.compute_dtype is not None and x.dtype is not self.compute_dtype:  # a wider residual
            h = blocks[0].ln_1(x, self.compute_dtype)
        for i, block in enumerate(blocks):
            next_ln = blocks[i + 1].ln_1 if i + 1 < len(blocks) else self.ln_f
            if i < recompute:
                x, h = RecomputedBlock.apply(x, h, block, next_ln)
            else:
                x, h = block(x, h, next_ln)
        x = h
        head = self.wte.weight if self.config.tie_weights else self.lm_head.weight
        if self.vocab_parallel is not None:  # logits of this rank's vocabulary shard, never gathered
            return self.vocab_parallel(x, as_dtype_of(head, x), targets)
        if targets is not None and self.fused_lm_head:
            return None, F.lm_head_cross_entropy(x, as_dtype_of(head, x), targets)
        logits = F.linear(x, as_dtype_of(head, x))
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return logits, loss

    @no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator=None, vocab_limit: int | None = None) -> Tensor:
        """Sample max_new_tokens after the prompt idx [B, T]; the context is cropped to block_size.

        vocab_limit keeps samples below the tokenizer's size (the model's vocabulary is padded)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0: always the likeliest token), got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ConfigError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
        rng = generator if generator is not None else np.random.default_rng(0)
        out = idx.numpy().astype(np.int64)
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            ctx = Tensor(out[:, -self.config.block_size:], device=idx.device)
            logits, _ = self(ctx)
            last = logits[:, -1, :vocab_limit].numpy().astype(np.float64) / max(temperature, 1e-8)
            if top_k is not None:
                kth = np.sort(last, axis=-1)[:, -min(top_k, last.shape[-1])][:, None]
                last = np.where(last < kth, -np.inf, last)
            p = np.exp(last - last.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            nxt = np.array([[rng.choice(p.shape[-1], p=row)] for row in p])
            out = np.concatenate([out, nxt], axis=1)
        self.train(was_training)
        return Tensor(out, device=idx.device)
