"""A training run's configuration and its checks: `TrainConfig` (every knob of `kiln train`), the
device it names and the precision it sets (paper §5: fp32, tf32, bf16 over fp32 masters, fp64).
A bad value is a ConfigError before anything is written."""

from __future__ import annotations

from dataclasses import dataclass, field

import kiln
from kiln.backend import cuda_is_available, device as parse_device
from kiln.errors import ConfigError, NotBuiltError

PRECISIONS = ("fp32", "tf32", "bf16", "fp64")
BF16_RESIDUALS = ("fp32", "bf16")  # the residual stream's dtype in bf16 (apply_precision)
PARALLEL = ("none", "ddp", "zero1", "zero2", "fsdp")
SHARDED = ("zero1", "zero2", "fsdp")  # parallel modes whose optimizer state lives in shards, one per rank


@dataclass
class TrainConfig:
    model: str = "tiny"                      # a preset name (kiln.nn.PRESETS)
    model_overrides: dict = field(default_factory=dict)
    data: str | None = None                  # a folder made by `kiln prepare`; None: the bundled corpus
    vocab_size: int | None = None            # the data's token ids are below this; default: its meta.json's
    tokenizer: str | None = None             # a tokenizer file or folder; default: the data folder's
    out_dir: str = "runs"
    run_name: str | None = None
    device: str = "auto"                     # auto: cuda when there is a GPU, else cpu
    precision: str = "fp32"
    bf16_residual: str = "fp32"              # bf16: the residual stream in fp32 (autocast's policy) or bf16
    batch_size: int | None = None            # None here and below: the preset's recipe (RECIPES)
    seq_len: int | None = None               # default: the model's context
    grad_accum: int = 1
    max_steps: int | None = None
    lr: float | None = None
    min_lr: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    betas: tuple | None = None
    eps: float = 1e-8
    grad_clip: float | None = None
    eval_interval: int = 100
    eval_iters: int = 20
    seed: int = 1337
    sample_tokens: int = 300
    sample_prompt: str = "The "
    progress: bool = True
    profile: bool = False                    # steps 3-6 op by op, 5-6 profiled: everything in run/profile/
    checkpoint_interval: int = 0             # checkpoint every N steps; 0: only at the end (and on SIGINT/SIGTERM)
    keep_checkpoints: int = 3                # the run folder keeps the newest K checkpoints
    async_checkpoint: bool = True            # write checkpoints on a background thread
    init_from: str | None = None             # start from these weights: a kiln run or a Hugging Face GPT-2 folder
    cuda_graph: bool = True                  # on CUDA, replay each step from the third as one captured CUDA graph
    parallel: str = "none"                   # ddp: data parallel over the launcher's ranks (kiln.distributed)
    global_batch: int | None = None          # tokens per optimizer step; sets grad_accum (Algorithm 1, line 1)
    bucket_mb: float = 25.0                  # ddp: gradient bucket size in MB
    tp: int = 1                              # tensor-parallel ranks per model replica: heads, MLP, vocabulary split (§4.2)
    cp: int = 1                              # context-parallel ranks per model replica: each sequence split (§4.3)
    cp_transport: str = "p2p"                # how K/V reach the other cp ranks: p2p (ring), all_gather, all_to_all
    tp_chunks: int = 1                       # async TP: each row-parallel all-reduce in N chunks, overlapping GEMMs
    adamw_in_backward: bool | None = None    # update each parameter inside backward, keep no gradients (kiln.optim.adamw)
    adamw_clip_via: str | None = None        # its exact clip: "recompute" (a second backward) or "host" (gradients parked in host memory)
    recompute_blocks: int | None = None      # the first N blocks keep only their inputs; backward recomputes the rest
    recompute_norm_gelu: bool | None = None  # backward makes the LayerNorm and GELU outputs again instead of keeping them

    def __post_init__(self):
        """Fill every training setting left None from the model preset's recipe (flags override it)."""
        recipe = RECIPES.get(self.model, RECIPES["tiny"])  # an unknown preset is refused by kiln.nn.preset
        if self.lr is not None and self.min_lr is None:  # a given lr keeps the recipe's decay ratio
            self.min_lr = self.lr * recipe["min_lr"] / recipe["lr"]
        for name, value in recipe.items():
            if name == "global_batch":  # through accumulation, unless grad_accum was given
                if self.global_batch is None and self.grad_accum == 1:
                    self.global_batch = value
            elif getattr(self, name) is None:
                setattr(self, name, value)
        self.betas = tuple(self.betas)

    def describe_recipe(self) -> str:
        """The optimizer schedule this run uses, in one line (the preset's recipe, as flags changed it)."""
        batch = f"{self.global_batch:,} tokens a step" if self.global_batch else f"{self.grad_accum} micro-batch(es) a step"
        clip = {"recompute": "; the exact clip's second backward)", "host": "; the exact clip's gradients in host memory)"}
        memory = "".join([", AdamW inside backward (no gradients kept" +
                          (clip[self.adamw_clip_via] if self.grad_clip > 0 else ")")
                          if self.adamw_in_backward else "",
                          ", LayerNorm and GELU outputs recomputed" if self.recompute_norm_gelu else "",
                          f", the first {self.recompute_blocks} blocks recomputed" if self.recompute_blocks else ""])
        return (f"lr {self.lr:g} -> {self.min_lr:g} (cosine), {self.warmup_steps} warm-up steps, {self.max_steps} "
                f"steps, {batch}, weight decay {self.weight_decay:g}, betas {self.betas}, clip {self.grad_clip:g}{memory}")

    def validate(self) -> None:
        positive = ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_iters")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size <= 0):
            raise ConfigError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len <= 0):
            raise ConfigError(f"seq_len must be a positive integer, got {self.seq_len!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ConfigError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"grad_clip and weight_decay must be >= 0, got {self.grad_clip}, {self.weight_decay}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; allowed: {', '.join(PRECISIONS)}")
        if self.bf16_residual not in BF16_RESIDUALS:
            raise ConfigError(f"unknown bf16_residual {self.bf16_residual!r}; allowed: {', '.join(BF16_RESIDUALS)}")
        if self.sample_tokens < 0:
            raise ConfigError(f"sample_tokens must be >= 0, got {self.sample_tokens}")
        if not isinstance(self.checkpoint_interval, int) or self.checkpoint_interval < 0:
            raise ConfigError(f"checkpoint_interval must be an integer >= 0 (0: only at the end), "
                              f"got {self.checkpoint_interval!r}")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints must be an integer >= 1, got {self.keep_checkpoints!r}")
        if self.parallel not in PARALLEL:
            raise ConfigError(f"unknown parallel mode {self.parallel!r}; allowed: {', '.join(PARALLEL)}")
        if self.global_batch is not None and (not isinstance(self.global_batch, int) or self.global_batch <= 0):
            raise ConfigError(f"global_batch must be a positive number of tokens, got {self.global_batch!r}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")
        for name in ("tp", "cp", "tp_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        from kiln.distributed.context_parallel import TRANSPORTS
        if self.cp_transport not in TRANSPORTS:
            raise ConfigError(f"unknown cp_transport {self.cp_transport!r}; allowed: {', '.join(TRANSPORTS)}")
        if not isinstance(self.adamw_in_backward, bool):
            raise ConfigError(f"adamw_in_backward must be true or false, got {self.adamw_in_backward!r}")
        from kiln.optim.adamw import CLIP_VIA
        if self.adamw_clip_via not in CLIP_VIA:
            raise ConfigError(f"adamw_clip_via must be one of {', '.join(CLIP_VIA)}, got {self.adamw_clip_via!r}")
        if not isinstance(self.recompute_blocks, int) or isinstance(self.recompute_blocks, bool) \
                or self.recompute_blocks < 0:
            raise ConfigError(f"recompute_blocks must be an integer >= 0, got {self.recompute_blocks!r}")
        if not isinstance(self.recompute_norm_gelu, bool):
            raise ConfigError(f"recompute_norm_gelu must be true or false, got {self.recompute_norm_gelu!r}")
        if self.adamw_in_backward:
            self._check_in_backward()


    def _check_in_backward(self) -> None:
        """What AdamW in backward cannot be combined with yet: each names what is not built."""
        if self.grad_accum != 1 or self.global_batch is not None:
            raise NotBuiltError(f"adamw_in_backward with grad_accum {self.grad_accum} / global_batch "
                                f"{self.global_batch}: gradient accumulation needs the gradients kept between "
                                "micro-batches, which AdamW in backward drops; use grad_accum 1 and no global_batch")
        if self.parallel != "none" or self.tp * self.cp > 1:
            raise NotBuiltError(f"adamw_in_backward with parallel={self.parallel!r}, tp={self.tp}, cp={self.cp}: "
                                "updating inside backward after each gradient's all-reduce is not built; "
                                "it trains on one device (parallel none, tp 1, cp 1)")


def resolve_device(name: str):
    if name == "auto":
        return parse_device("cuda" if cuda_is_available() else "cpu")
    dev = parse_device(name)
    dev.backend.ensure_available()  # a DeviceError names what is missing for cuda
    return dev


def apply_precision(model, precision: str, device, bf16_residual: str = "fp32") -> None:
    """fp32: strict fp32 products (GEMMs and attention); tf32: fp32 tensors, tf32 tensor-core products, the
    GEMMs' and attention's (GPU only); bf16: bf16
    activations and GEMM operands over fp32 master weights and optimizer state; fp64: float64.

    bf16_residual (bf16 only): "fp32" keeps the residual stream and the LayerNorms in fp32, their outputs
    rounded to bf16 for the GEMMs, as torch.autocast does; "bf16" keeps the residual in bf16 too (fewer
    bytes through the LayerNorms, a loss curve further from PyTorch's: benchmarks/bf16_residual.py)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    if precision == "tf32" and "tf32" not in device.backend.MATMUL_PRECISIONS:
        raise ConfigError("precision tf32 is a GPU mode (tensor-core GEMMs); on the CPU use fp32")
    if bf16_residual not in BF16_RESIDUALS:
        raise ConfigError(f"unknown bf16_residual {bf16_residual!r}; allowed: {', '.join(BF16_RESIDUALS)}")
    model.compute_dtype = kiln.bfloat16 if precision == "bf16" else None
    model.residual_dtype = kiln.float32 if precision == "bf16" and bf16_residual == "fp32" else None
    device.backend.set_matmul_precision("fp32" if precision == "fp64" else precision)



_TABLE_1 = dict(lr=6e-4, min_lr=6e-5, warmup_steps=715, max_steps=19_073, global_batch=524_288,
                weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0, adamw_in_backward=False, adamw_clip_via="recompute",
                recompute_blocks=0, recompute_norm_gelu=False)
RECIPES = {  # each preset's training recipe: what TrainConfig's None settings become
    # the CPU default: the bundled corpus in about two minutes on two cores
    "tiny": dict(batch_size=16, max_steps=1200, lr=2e-3, min_lr=2e-4, warmup_steps=40, global_batch=None,
                 weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0, adamw_in_backward=False,
                 adamw_clip_via="recompute", recompute_blocks=0, recompute_norm_gelu=False),
    # the paper's Table 1 (GPT-2 124M): 524,288 tokens a step through accumulation, 19,073 steps
    "gpt2-124m": dict(batch_size=16, **_TABLE_1),
    # Table 5 gives B=2 and the same 524,288-token global batch; its optimizer settings are Table 1's
    "gpt2-2.4b": dict(batch_size=2, **_TABLE_1),
    # §6.5 on an H200: 10.58B parameters in fp32 at B2 T1024, one micro-batch a step (accumulation keeps
    # gradients), AdamW inside backward (12 bytes a parameter: 118.2 GiB), Table 1's optimizer and an exact
    # clip through host memory (each gradient parked in 42 GB of pinned host memory while the norm is
    # summed: on an H100 the step took 2.51 s where the clip's second backward took 3.60 and no clip 2.00);
    # activations: the blocks make their LayerNorm and GELU outputs again (240 MiB a block, not 384) and
    # the first 16 of 92 are recomputed (48 MiB each): 18.6 GiB (benchmarks/largest_model.py)
    "gpt2-largest": dict(batch_size=2, **{**_TABLE_1, "global_batch": None, "adamw_in_backward": True,
                                          "adamw_clip_via": "host", "recompute_blocks": 16,
                                          "recompute_norm_gelu": True}),
}


def mesh_sizes(config: TrainConfig, model_config, seq_len: int, world_size: int) -> dict:
    """{"dp", "cp", "tp"}: the ranks of a run as model replicas (dp) of tp x cp ranks each; a
    ConfigError names a layout that cannot hold this model or these ranks."""
    tp, cp = config.tp, config.cp
    if world_size % (tp * cp):
        raise ConfigError(f"tp {tp} x cp {cp} = {tp * cp} ranks per model replica do not divide the {world_size} "
                          f"ranks of this run: start a multiple of {tp * cp} ranks")
    dp = world_size // (tp * cp)
    if dp > 1 and config.parallel == "none":
        raise ConfigError(f"{world_size} ranks with tp {tp} x cp {cp} hold {dp} model replicas: train them data "
                          "parallel with --parallel ddp (or zero1, zero2, fsdp), or start tp x cp ranks")
    heads, vocab = model_config.n_head, model_config.vocab_size
    if heads % tp or vocab % tp:
        raise ConfigError(f"tp {tp} splits the model's {heads} heads and {vocab} vocabulary rows over {tp} ranks: "
                          f"both must be multiples of {tp} (model.n_head, model.vocab_size)")
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"cp {cp} cuts each sequence into 2 x {cp} chunks (the zigzag load balance): seq_len "
                          f"{seq_len} must be a multiple of {2 * cp}")
    if cp > 1 and config.cp_transport == "all_to_all" and (heads // tp) % cp:
        raise ConfigError(f"cp_transport all_to_all splits each tp rank's {heads // tp} heads over cp {cp} ranks: "
                          f"they must be a multiple of {cp}; use p2p or all_gather")
    return {"dp": dp, "cp": cp, "tp": tp}


def accumulation_steps(config: TrainConfig, seq_len: int, replicas: int) -> int:
    """Micro-steps per optimizer step: global_batch / (B·T·W) (Algorithm 1, line 1), W the model
    replicas (data-parallel ranks; tp and cp ranks share their replica's rows), or grad_accum."""
    if config.global_batch is None:
        return config.grad_accum
    per = config.batch_size * seq_len * replicas
    if config.grad_accum != 1:
        raise ConfigError(f"give global_batch ({config.global_batch}) or grad_accum ({config.grad_accum}), "
                          "not both: global_batch sets grad_accum")
    if config.global_batch % per:
        raise ConfigError(f"global_batch {config.global_batch} tokens is not a multiple of batch_size x seq_len "
                          f"x data-parallel ranks = {config.batch_size} x {seq_len} x {replicas} = {per}")
    return config.global_batch // per


RESUME_OVERRIDES = ("max_steps", "device", "progress", "checkpoint_interval", "keep_checkpoints", "parallel",
                    "batch_size",  # with another number of ranks: batch_size x ranks stays the loader's step
                    "tp", "cp", "cp_transport", "tp_chunks",  # a tp/cp run's checkpoints are the dense model's
                    "async_checkpoint", "eval_interval", "sample_tokens",
                    "adamw_in_backward", "adamw_clip_via", "recompute_blocks",
                    "recompute_norm_gelu")  # the same state, less memory
