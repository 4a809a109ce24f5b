"""The Trainer: the one training loop, shared by `kiln train` and the Python API.

A Trainer checks its whole configuration (kiln.train.config) before it writes anything, then
trains with AdamW (warm-up + cosine schedule, global-norm clipping, gradient accumulation),
evaluates on the held-out split, and fills one run folder (kiln.checkpoint.run_folder: config.json,
metrics.jsonl, loss.png, model weights, the tokenizer, a sample and checkpoints/ with the whole
state, so `Trainer.from_checkpoint` / `kiln train --resume` continue bit for bit; SIGINT/SIGTERM
save first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np

import kiln
from kiln.backend import device as parse_device
from kiln.checkpoint.run_folder import (
    LOSS_PLOT,
    METRICS,
    WEIGHTS,
    jsonable,
    load_pretrained,
    logged_rows,
    new_run_dir,
    plot_losses,
    save_weights,
    write_config,
)
from kiln.checkpoint.sharded import shard_path
from kiln.data.corpus import bundled_dataset
from kiln.data.shards import unigram_entropy
from kiln.errors import ConfigError, DataError, NotBuiltError
from kiln.graph import CapturedStep, GraphCaptureError
from kiln.launch import BadStepError, RankAgent
from kiln.nn import GPT, PRESETS, GPTConfig, preset
from kiln.optim import AdamW, gpt_param_groups, warmup_cosine_lr
from kiln.paths import output_folder
from kiln.profiler.cost import gpt_flops_per_token, mfu
from kiln.train.config import (
    RESUME_OVERRIDES,
    SHARDED,
    TrainConfig,
    accumulation_steps,
    apply_precision,
    mesh_sizes,
    resolve_device,
)


def world_group(config: TrainConfig, device):
    """The world process group of a parallel run (NCCL on CUDA, MPI on the CPU); None for one
    process (parallel "none" without tensor or context parallelism)."""
    if config.parallel == "none" and config.tp == config.cp == 1:
        return None
    from kiln.distributed import init_process_group
    return init_process_group("nccl" if device.type == "cuda" else "mpi")



class Trainer:
    def __init__(self, config: TrainConfig):
        from kiln.data.loader import ShardLoader, read_meta
        from kiln.data.tokenizer import BPE_FILE, BYTES_FILE, load_tokenizer, padded_vocab_size
        config.validate()
        self.config = config
        output_folder(config.out_dir, "out_dir (--out)")
        self.device = resolve_device(config.device)
        self.group = world_group(config, self.device)
        self.rank, self.world_size = (self.group.rank, self.group.size) if self.group else (0, 1)
        data = Path(config.data) if config.data is not None else bundled_dataset()
        if not data.exists():
            raise DataError(f"data path {str(data)!r} does not exist; make one with `kiln prepare`")
        self.data_dir = data
        meta = read_meta(data) if data.is_dir() else None
        # the tokenizer: --tokenizer's, else the data folder's; shards alone (llm.c's) may have none
        source = config.tokenizer or (data if any((data / n).is_file() for n in (BPE_FILE, BYTES_FILE)) else None)
        self.tokenizer = load_tokenizer(source) if source is not None else None
        self.vocab_size = config.vocab_size or (meta or {}).get("vocab_size") or \
            (self.tokenizer.vocab_size if config.tokenizer else None)  # the ids the data may hold
        if self.vocab_size is None:
            raise DataError(f"{data}: has no meta.json, so its vocabulary is unknown (kiln prepare writes meta.json "
                            "last: a prepare that stopped leaves none); for shards made elsewhere (llm.c), give "
                            "it with --vocab-size N or --tokenizer FILE")
        self.vocab_source = ("--vocab-size" if config.vocab_size else f"{data / 'meta.json'}" if meta
                             else f"the tokenizer {config.tokenizer}")
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens, more than the data's "
                              f"vocabulary of {self.vocab_size} (--vocab-size)")
        overrides = dict(config.model_overrides)
        pretrained = load_pretrained(config.init_from) if config.init_from else None
        if pretrained is not None:  # the weights fix the architecture; explicit overrides (dropout) win
            overrides = {**dataclasses.asdict(pretrained.config), **overrides}
        if "vocab_size" not in overrides:  # the data's vocabulary, padded for GEMM shapes (as prepare pads it)
            overrides["vocab_size"] = padded_vocab_size(self.vocab_size)
        self.model_config: GPTConfig = preset(config.model, **overrides)
        self.seq_len = config.seq_len or self.model_config.block_size
        if self.seq_len > self.model_config.block_size:
            raise ConfigError(f"seq_len {self.seq_len} is longer than the model's context "
                              f"{self.model_config.block_size}")
        # the ranks as model replicas (dp) of tp x cp ranks each, on a DeviceMesh when tp x cp > 1
        self.mesh = None
        self.replicas, self.replica = self.world_size, self.rank
        if config.tp * config.cp > 1:
            from kiln.distributed import DeviceMesh
            sizes = mesh_sizes(config, self.model_config, self.seq_len, self.world_size)
            self.mesh = DeviceMesh({"dp": sizes["dp"], "cp": sizes["cp"], "tp": sizes["tp"]}, self.group)
            self.replicas, self.replica = sizes["dp"], self.mesh.coordinate["dp"]
            from kiln.distributed.mpi_engine import REDUCIBLE, MPIEngine
            if config.tp > 1 and config.precision == "bf16" and isinstance(self.group.engine, MPIEngine):
                raise ConfigError(f"tp {config.tp} in bf16 sums bf16 activations over the tp ranks, which MPI cannot "
                                  f"reduce (it reduces {', '.join(REDUCIBLE)}): on CPU ranks use precision fp32 or "
                                  "fp64 with tp")
        self.grad_accum = accumulation_steps(config, self.seq_len, self.replicas)
        # on cuda the loaders stage batches through pinned memory on a copy stream (Algorithm 2);
        # replica r of W reads its own rows of each global batch (the loader's rank stride); its tp and
        # cp ranks read the same rows (each cp rank keeps its tokens: ModelParallel.sequence)
        loader_args = dict(batch_size=config.batch_size, seq_len=self.seq_len, seed=config.seed, device=self.device,
                           rank=self.replica, world_size=self.replicas, vocab_size=self.vocab_size)
        self.train_loader = ShardLoader(data, "train", **loader_args)
        self.val_loader = ShardLoader(data, "val", **loader_args)
        if self.vocab_size > self.model_config.vocab_size:
            raise ConfigError(f"the data's vocabulary of {self.vocab_size} tokens ({self.vocab_source}) is larger "
                              f"than the model's vocab_size {self.model_config.vocab_size}")
        kiln.manual_seed(config.seed)
        self.model = GPT(self.model_config, generator=kiln.Generator(config.seed))
        self.model.to(self.device, dtype=self.parameter_dtype)
        if pretrained is not None:
            self.model.load_state_dict(pretrained.state_dict())
        apply_precision(self.model, config.precision, self.device, config.bf16_residual)
        self.model_parallel = None  # tp x cp > 1: the model's shards on this rank (§4.2, §4.3)
        self.dense_model = self.model  # what rank 0 writes and samples from (tp/cp: gathered at the end)

        self.model.recompute_blocks = config.recompute_blocks
        self.model.recompute_norm_gelu = config.recompute_norm_gelu

        def adamw(model):
            return AdamW(gpt_param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas,
                         eps=config.eps, in_backward=config.adamw_in_backward, clip_via=config.adamw_clip_via)

        self.ddp = None  # the data-parallel wrapper: DDP, ZeRO-1/2 or FSDP (tp/cp: over the dp x cp ranks)
        self.sharded = config.parallel in SHARDED  # the optimizer state (and more) in shards, one per rank
        if self.mesh is not None:  # every rank built the same dense model (same seed) and cuts its shards
            from kiln.distributed import ModelParallel
            self.model_parallel = ModelParallel(self.model, self.mesh, chunks=config.tp_chunks,
                                                transport=config.cp_transport, bucket_cap_mb=config.bucket_mb,
                                                parallel="ddp" if config.parallel == "none" else config.parallel,
                                                optimizer=adamw)
            self.dense_model = None
            self.adamw, self.optimizer, self.ddp = (self.model_parallel.adamw, self.model_parallel.optimizer,
                                                    self.model_parallel.data_parallel)
            self.sharded = self.model_parallel.sharded
        else:
            self.optimizer = adamw(self.model)
            self.adamw = self.optimizer  # ZeRO/FSDP: self.optimizer becomes its sharded form
        # ZeRO/FSDP checkpoints are a file per rank; a tp/cp run's hold the dense model (gathered), in one file
        self.shard_files = self.sharded and self.model_parallel is None
        if self.model_parallel is None and self.group is not None:
            # rank 0's weights everywhere, gradients averaged in buckets
            from kiln.distributed import (
                DistributedDataParallel,
                FullyShardedDataParallel,
                ZeroDataParallel,
            )
            if config.parallel == "ddp":
                self.ddp = DistributedDataParallel(self.model, self.group, bucket_cap_mb=config.bucket_mb)
            elif config.parallel == "fsdp":
                self.ddp = FullyShardedDataParallel(self.model, self.optimizer, group=self.group)
            else:
                self.ddp = ZeroDataParallel(self.model, self.optimizer, stage=int(config.parallel[-1]),
                                            group=self.group, bucket_cap_mb=config.bucket_mb)
            if self.sharded:
                self.optimizer = self.ddp.optimizer
        self.step = 0
        self.run_dir: Path | None = None
        self.last_loss: float | None = None
        self.sample_rng = np.random.default_rng(0)  # the sampling RNG; a checkpoint keeps its state
        self.stop_signal: int | None = None        # SIGINT/SIGTERM received: stop after this step
        self.checkpoint_stalls: list[float] = []   # seconds each checkpoint held up training
        self.val_tokens = 0                         # tokens the last evaluation read
        self._graph_step: CapturedStep | None = None  # the step as a CUDA graph, recorded at step 2
        self._graph_failed = False                      # recording it failed once: op by op from then on
        self.launch = RankAgent.from_env()  # under `kiln launch`: heartbeats, bad-step policy, faults
        self._faults = self.launch.faults if self.launch is not None else None
        if config.adamw_in_backward and config.cuda_graph and self.device.backend.captures_graphs:
            warnings.warn("AdamW in backward runs every step op by op: capturing its updates (lr and step count "
                          "from the host, inside backward) as a CUDA graph is not built", RuntimeWarning, stacklevel=2)
        self._before_step = None  # (params, moments, optimizer step) before this step, for the skip policy
        self._rolled_back: set[int] = set()

    @property
    def parameter_dtype(self) -> str:
        """The dtype of the weights (and AdamW's moments): float64 for fp64, else float32 masters."""
        return "float64" if self.config.precision == "fp64" else "float32"

    def describe_vocabulary(self) -> str:
        """Where the model's vocab_size came from, in words (a preset's own size is often replaced)."""
        v, preset_v = self.model_config.vocab_size, PRESETS[self.config.model].vocab_size
        if "vocab_size" in self.config.model_overrides:
            return f"model vocab_size {v}: the model settings' (--set or a resumed checkpoint's; the data has {self.vocab_size} tokens)"
        if self.config.init_from:
            return f"model vocab_size {v}: the pretrained weights' ({self.config.init_from})"
        return (f"model vocab_size {v}: the data's {self.vocab_size} tokens ({self.vocab_source}) padded to a "
                f"multiple of 64" + ("" if v == preset_v else f", not the preset's {preset_v}"))

    # ------------------------------------------------------------------ steps
    def lr_at(self, step: int) -> float:
        c = self.config
        return warmup_cosine_lr(step, c.lr, c.min_lr, c.warmup_steps, c.max_steps)

    def _batch(self, loader):
        x, y = loader.next_batch()  # fresh arrays on the trainer's device (kiln's stream): no copy
        return kiln.Tensor._wrap(x, self.device), kiln.Tensor._wrap(y, self.device)

    def _loss(self, x, y):
        """The model's loss on this replica's rows x, y (a cp rank's: on its tokens and positions)."""
        if self.model_parallel is None:
            return self.model(x, y)[1]
        return self.model(*self.model_parallel.sequence(x, y))[1]

    def train_step(self, eager: bool = False) -> dict:
        """One optimizer step over grad_accum micro-batches; returns loss, lr and grad norm.

        On CUDA with config.cuda_graph, from the third step on (the first two warm the allocator,
        kernels and GEMM plans) the step runs as one captured CUDA graph; eager=True, the
        profiler and models with dropout (its random stream advances on the host) run it op by op."""
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = [t for _ in range(self.grad_accum) for t in self._batch(self.train_loader)]
        if self._faults is not None:
            self._faults.before_step(self.step + 1)
        if self.launch is not None and self.launch.policy == "skip":
            self._before_step = self._update_state_copy()
        loss = None
        if not eager and self._use_graph():
            if self._graph_step is None:
                self._refresh_kept_copies()
                self._graph_step = CapturedStep(self._step_body)
            try:
                loss, norm = self._graph_step(*batches)
            except GraphCaptureError as e:  # recording failed before anything ran: this step goes op by op
                self._graph_step, self._graph_failed = None, True
                warnings.warn(f"the training step cannot run as a CUDA graph, continuing op by op: {e}",
                              RuntimeWarning, stacklevel=2)
        if loss is None:
            loss, norm = self._step_body(*batches)
        self.last_loss = loss.item()  # the step's one host sync (with the norm's): the logged values
        self.step += 1
        return {"step": self.step, "loss": self.last_loss, "lr": lr,
                "grad_norm": None if norm is None else norm.item()}

    def _refresh_kept_copies(self) -> None:
        """Make, or recast when its parameter changed since (a restored or loaded state), every parameter's
        kept compute-dtype copy, now: a graph replay reads the copies without checking versions (AdamW
        keeps them current), and a copy made or recast inside the capture would be recast at every replay
        (a resumed run captures its first step). ZeRO writes the copies after its all-gather; FSDP keeps none."""
        dtype = self.model.compute_dtype
        if dtype is None or self.sharded:
            return
        for p in self.model.parameters():
            if p.dtype is not dtype:
                p.kept_copy(dtype).read(p)

    def _use_graph(self) -> bool:
        return (self.config.cuda_graph and self.device.backend.captures_graphs and self.step >= 2
                and not self.config.adamw_in_backward  # its updates run inside backward, from the host
                and self.model_parallel is None  # tp/cp steps: their capture is not yet run on a device
                and self.model_config.dropout == 0.0 and not self._graph_failed
                # an injected NaN or spike acts in Python inside its step: that one step runs op by op
                and not (self._faults is not None and self._faults.acts_inside_step(self.step + 1)))

    def _step_body(self, *batches):
        """zero_grad, forward and backward over the micro-batches (x0, y0, x1, y1, ...), clip, update:
        device work only, so that it can be recorded as a CUDA graph. (mean loss, grad norm)."""
        c, accum = self.config, self.grad_accum
        scale = self._faults.loss_scale(self.step + 1) if self._faults is not None else None
        if c.adamw_in_backward:  # one micro-batch, one device (TrainConfig says so): update inside backward
            loss = self._loss(*batches)
            if scale is not None:
                loss = loss * scale
            norm = self.optimizer.backward_step(loss, c.grad_clip if c.grad_clip > 0 else None)
            return loss.detach(), norm
        self.optimizer.zero_grad()
        total = None
        for i, (x, y) in enumerate(zip(batches[::2], batches[1::2])):
            # DDP: accumulation micro-steps communicate nothing; the last one all-reduces (Algorithm 1)
            with self.ddp.no_sync() if self.ddp is not None and i < accum - 1 else contextlib.nullcontext():
                loss = self._loss(x, y)
                if scale is not None:  # an injected loss spike or NaN (kiln.launch.faults)
                    loss = loss * scale
                (loss / accum).backward() if accum > 1 else loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.ddp is not None:
            self.ddp.wait_gradients()
        # the clip is fused into the optimizer's step: one norm pass, no scaling pass, no sync
        norm = None
        if c.grad_clip > 0 and self.model_parallel is not None:  # the dense model's norm, summed over the mesh
            norm = self.optimizer.clip_grad_norm_(c.grad_clip, self.model_parallel.grad_norm())
        elif c.grad_clip > 0:
            norm = self.optimizer.clip_grad_norm_(c.grad_clip)
        self.optimizer.step()
        total = total / accum if accum > 1 else total
        if self.group is not None:  # the logged loss is the global batch's
            self.group.all_reduce(total, "avg")
        return total, norm

    @kiln.no_grad()
    def evaluate(self) -> float:
        """Mean loss over eval_iters validation batches, the same batches every time; a split with
        fewer distinct batches is read once, not wrapped around (self.val_tokens: the tokens read)."""
        self.model.eval()
        self.val_loader.reset()
        losses = []
        n = min(self.config.eval_iters, self.val_loader.batches_per_epoch)
        self.val_tokens = n * self.val_loader.tokens_per_batch * self.replicas
        for _ in range(n):
            x, y = self._batch(self.val_loader)
            losses.append(self._loss(x, y).item())
        self.model.train()
        if self.group is None:
            return float(np.mean(losses))
        mean = kiln.tensor([np.mean(losses)], dtype="float64", device=self.device)
        self.group.all_reduce(mean, "avg")  # each rank evaluated its own rows: the mean over ranks
        return float(mean.item())

    def sample(self, prompt: str, tokens: int, seed: int | None = None) -> str:
        """Text after prompt; seed None draws from the trainer's sampling RNG (saved in checkpoints)."""
        if self.dense_model is None:
            raise NotBuiltError("a tensor/context-parallel run samples at the end of fit(), from the dense model "
                                "gathered there; sampling during the run is not built")
        ids = self.tokenizer.encode(prompt) or [0]
        out = self.dense_model.generate(kiln.tensor([ids], device=self.device), tokens, temperature=0.8,
                                        generator=self.sample_rng if seed is None else np.random.default_rng(seed),
                                        vocab_limit=self.tokenizer.vocab_size)
        return self.tokenizer.decode(out.numpy()[0].tolist())

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict:
        """Train for max_steps, evaluating every eval_interval steps; returns the run's summary."""
        from tqdm import tqdm
        c = self.config
        resumed = self.run_dir is not None  # Trainer.from_checkpoint: continue that run folder
        if self.rank != 0:  # rank 0 alone writes the run folder: logs, plots, samples, checkpoints
            return self._fit_without_writing()
        if not resumed:
            self.run_dir = self._launched_run_dir() or new_run_dir(c.out_dir, c.run_name, c.model)
            if self.tokenizer is not None:
                self.tokenizer.save(self.run_dir)
            write_config(self.run_dir, self.model_config, jsonable(dataclasses.asdict(c)),
                         data=str(self.data_dir), device=str(self.device))
        run = self.run_dir
        if self.shard_files:  # every rank writes its checkpoint shard into rank 0's run folder
            self.group.engine.exchange(str(run))
        entropy = unigram_entropy(self.train_loader.paths, self.vocab_size)
        tokens_per_step = c.batch_size * self.seq_len * self.grad_accum * self.replicas
        history = logged_rows(run / METRICS, self.step) if resumed else []
        evals = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
        checkpoints, saver, saved = self._checkpointing(run)
        flops_per_token = gpt_flops_per_token(self.model_config, self.seq_len)
        peak_flops = self.peak_flops()
        start = time.perf_counter()
        if self.launch is not None:
            self.launch.heartbeat(self.step, "start")
        with open(run / METRICS, "a" if resumed else "w") as log, self._stop_on_signals(), \
                self._reporting_failures(), \
                tqdm(total=c.max_steps, initial=self.step, disable=not c.progress, unit="step",
                     dynamic_ncols=True) as bar:
            while self._keep_going() and self.step < c.max_steps:
                if saver is not None:
                    saver.check()  # a failed background save is reported here, at the next step
                t0, before = time.perf_counter(), self.step
                try:
                    if c.profile and self.step == min(2, c.max_steps - 1):
                        row = self._profiled_steps(min(4, c.max_steps - self.step), run)
                    else:
                        row = self.train_step()
                except DataError as e:  # a shard changed under the run: keep the steps done so far
                    if saver is not None:
                        saver.wait()
                    if saved != self.step:
                        self.save_checkpoint(checkpoints)
                    raise DataError(f"{e}; saved step {self.step}: fix the data and continue with "
                                    f"`kiln train --resume {run}`") from None
                dt = (time.perf_counter() - t0) / (self.step - before)
                if self.step == 1:
                    self.device.backend.end_warmup()  # the paper's §5 allocator: learn, then flush step 0
                if self.launch is not None:
                    verdict = self._supervise_step(row, dt, checkpoints, saver)
                    if verdict == "rolled back":
                        saved = min(saved, self.step)
                        history[:] = [r for r in history if r["step"] <= self.step]
                        bar.n = self.step
                        continue
                    if verdict == "skipped":
                        row["skipped"] = True
                row["tokens_per_s"] = tokens_per_step / dt
                row["mfu"] = mfu(row["tokens_per_s"], flops_per_token, peak_flops)
                row["elapsed_s"] = time.perf_counter() - start
                if self.step % c.eval_interval == 0 or self.step == c.max_steps:
                    if self.launch is not None:
                        self.launch.heartbeat(self.step, "eval")
                    row["val_loss"] = self.evaluate()
                    self._steps_again()
                    row["val_tokens"] = self.val_tokens
                    evals.append((self.step, row["val_loss"]))
                history.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.1e}",
                                val=f"{evals[-1][1]:.3f}" if evals else "-",
                                tok_s=f"{row['tokens_per_s']:.0f}", mfu=f"{100 * row['mfu']:.1f}%")
                if self._faults is not None:
                    self._faults.after_step(self.step)
                if c.checkpoint_interval and self.step // c.checkpoint_interval > saved // c.checkpoint_interval \
                        and self.step < c.max_steps:  # not on this rank's own stop signal: ranks save alike
                    saved = self._checkpoint(checkpoints, saver)
                    self._steps_again()
            if saved != self.step:  # the end, or a signal: the step is done, save it
                self._checkpoint(checkpoints, saver)
            if saver is not None:
                saver.wait()
            if self.launch is not None:
                self.launch.heartbeat(self.step, "finish")
        elapsed = time.perf_counter() - start
        if self.stop_signal is not None:
            plot_losses(history, run / LOSS_PLOT, entropy)
            return {"run_dir": str(run), "steps": self.step, "interrupted": signal.Signals(self.stop_signal).name,
                    "checkpoint": str(checkpoints.path_for(self.step)) if self.step else None, "elapsed_s": elapsed,
                    "final_train_loss": self.last_loss}
        self._gather_for_writing()
        self.save_weights(run / WEIGHTS)
        plot_losses(history, run / LOSS_PLOT, entropy)
        text = self.sample(c.sample_prompt, c.sample_tokens) if c.sample_tokens and self.tokenizer else ""
        (run / "sample.txt").write_text(text)
        steady = [r["tokens_per_s"] for r in history[len(history) // 5:]] or [history[-1]["tokens_per_s"]]
        summary = {"run_dir": str(run), "steps": self.step, "final_train_loss": history[-1]["loss"],
                   "final_val_loss": evals[-1][1], "val_tokens": self.val_tokens, "unigram_entropy": entropy,
                   "tokens_per_s": float(np.median(steady)), "elapsed_s": elapsed, "sample": text,
                   "mfu": mfu(float(np.median(steady)), flops_per_token, peak_flops),
                   "flops_per_token": flops_per_token, "peak_tflops": peak_flops / 1e12,
                   "checkpoint_stall_s": float(np.median(self.checkpoint_stalls)) if self.checkpoint_stalls else None}
        (run / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _keep_going(self) -> bool:
        """No stop signal here (nor, with several ranks, on any rank: they stop at the same step).
        Tested before the step count, at the end too, so all ranks leave fit() on the same path."""
        if self.group is not None:
            flag = kiln.tensor([self.stop_signal or 0], dtype="int64", device=self.device)
            self.group.all_reduce(flag, "max")
            self.stop_signal = int(flag.item()) or None
        return self.stop_signal is None

    def _fit_without_writing(self) -> dict:
        """fit() on a rank other than 0: the same steps, evaluations and collectives, no files."""
        c = self.config
        val = None
        checkpoints = None
        # ZeRO/FSDP and tp/cp checkpoints are collective: this rank writes its shard, or gathers the
        # dense state for rank 0, at rank 0's steps
        collective, saved = self.sharded or self.model_parallel is not None, self.step
        if self.shard_files:
            from kiln.checkpoint import CheckpointFolder
            run = Path(self.group.engine.exchange(None)[0])
            checkpoints = CheckpointFolder(run / "checkpoints", c.keep_checkpoints)
        if self.launch is not None:
            self.launch.heartbeat(self.step, "start")
        with self._stop_on_signals(), self._reporting_failures():
            while self._keep_going() and self.step < c.max_steps:
                t0 = time.perf_counter()
                row = self.train_step()
                if self.launch is not None:
                    self._supervise_step(row, time.perf_counter() - t0, None, None)
                if self.step % c.eval_interval == 0 or self.step == c.max_steps:
                    if self.launch is not None:
                        self.launch.heartbeat(self.step, "eval")
                    val = self.evaluate()
                    self._steps_again()
                if self._faults is not None:
                    self._faults.after_step(self.step)
                if collective and c.checkpoint_interval and self.step < c.max_steps \
                        and self.step // c.checkpoint_interval > saved // c.checkpoint_interval:
                    saved = self._checkpoint(checkpoints, None)
                    self._steps_again()
            if collective and saved != self.step:
                self._checkpoint(checkpoints, None)
        if self.stop_signal is None:
            self._gather_for_writing()
        if self.launch is not None:
            self.launch.heartbeat(self.step, "finish")
        return {"run_dir": None, "rank": self.rank, "steps": self.step, "final_train_loss": self.last_loss,
                "final_val_loss": val,
                **({"interrupted": signal.Signals(self.stop_signal).name} if self.stop_signal else {})}

    def peak_flops(self) -> float:
        """The device's measured GEMM ceiling (FLOP/s) in this run's precision (measured once per device
        and cached: kiln.profiler.ceilings); the denominator of the logged MFU."""
        from kiln.profiler.ceilings import ceilings
        gemm = ceilings(self.device)["gemm_tflops"]
        return 1e12 * (gemm.get(self.config.precision) or gemm["fp32"])  # CPU bf16 GEMMs run in fp32

    # ------------------------------------------------------------------ under `kiln launch` (paper §4.4)
    def _launched_run_dir(self) -> Path | None:
        """`kiln launch` names the run folder, the same in every attempt."""
        if self.launch is None:
            return None
        self.launch.run_dir.mkdir(parents=True, exist_ok=True)
        return self.launch.run_dir

    def _checkpoint(self, checkpoints, saver) -> int:
        if self.launch is not None:
            self.launch.heartbeat(self.step, "checkpoint")
        step = self.save_checkpoint(checkpoints, saver)
        if self._faults is not None and checkpoints is not None:  # a sharded checkpoint's fault damages
            # this rank's own shard file (a tp/cp rank other than 0 writes no file)
            path = checkpoints.path_for(step)
            self._faults.after_checkpoint(step, shard_path(path, self.rank, self.world_size) if self.shard_files
                                          else path, saver)
        return step

    def _steps_again(self) -> None:
        """After an eval or a checkpoint inside the loop: heartbeat phase "step" again (the same step
        number, a new time), so the supervisor times the next step by the step timeout; left at "eval"
        or "checkpoint" until that step's own heartbeat, a rank stuck in its collective would be called
        hung only after the startup timeout (900 s). Not after the last checkpoint: the wait for its
        background write and the "finish" heartbeat follow, under the checkpoint's timeout."""
        if self.launch is not None:
            self.launch.heartbeat(self.step, "step")

    def _supervise_step(self, row: dict, seconds: float, checkpoints, saver) -> str:
        """Heartbeat and bad-step check of the step just done; under the launch's policy a NaN or a
        spike is skipped (its update undone in place, its batch dropped, as llm.c does) or rolled
        back to the newest checkpoint in place (a step bad again after a rollback is skipped);
        under `restart` it ends the rank (BadStepError) and the supervisor restarts the gang.
        Returns "ok", "skipped" or "rolled back"."""
        bad = self.launch.step_done(self.step, seconds, row["loss"], row["grad_norm"])
        if bad is None:
            return "ok"
        policy = self.launch.policy
        # every rank sees the same global loss and norm, so they agree; a rollback in place with
        # several ranks (all reading rank 0's newest checkpoint at once) is not built: a restart
        if policy == "rollback" and (self.world_size > 1 or bad.step in self._rolled_back
                                     or not checkpoints.checkpoints()):
            policy = "skip" if self._before_step is not None else "restart"
        if policy == "restart":
            raise BadStepError(bad)
        t0 = time.perf_counter()
        if policy == "skip":
            self._restore_update_state(self._before_step)
            action, lost, verdict = f"skipped in place: the update of step {bad.step} undone, its batch dropped", 1, \
                "skipped"
        else:
            if saver is not None:
                saver.wait()
            state, path = checkpoints.load_latest()
            self.load_state_dict(state)
            self._rolled_back.add(bad.step)
            action, lost, verdict = f"rolled back in place to step {self.step} ({path.name})", bad.step - self.step, \
                "rolled back"
        self.launch.report_incident(bad, action, time.perf_counter() - t0, lost)
        return verdict

    def _update_state_copy(self):
        """What an optimizer step changes, copied on the device (AdamW or its sharded form)."""
        return self.optimizer.update_state()

    def _restore_update_state(self, saved) -> None:
        """Undo a step in place (the same buffers: a captured graph stays valid)."""
        self.optimizer.restore_update_state(saved)
        self._refresh_kept_copies()

    @contextlib.contextmanager
    def _reporting_failures(self):
        """Under `kiln launch`, tell the supervisor why this rank is about to exit on an exception."""
        try:
            yield
        except BaseException as e:
            if self.launch is not None and not isinstance(e, KeyboardInterrupt):
                self.launch.report_failure(e, self.step + 1)  # the step in flight
            raise

    def _profiled_steps(self, n: int, run: Path) -> dict:
        """n steps op by op, the first n // 2 plain and the rest under the profiler (the profiler's own
        overhead is the difference of their median times); everything into run/profile/. The last row."""
        from kiln.profiler import Profiler
        from kiln.profiler.ceilings import ceilings
        plain, profiled = [], []
        for _ in range(n // 2):
            t0 = time.perf_counter()
            row = self.train_step(eager=True)
            plain.append(time.perf_counter() - t0)
        first = self.step + 1
        with Profiler(self.device, ceilings=ceilings(self.device)) as prof:
            for _ in range(n - n // 2):
                t0 = time.perf_counter()
                row = self.train_step(eager=True)  # op by op: the profiler times each kernel
                profiled.append(time.perf_counter() - t0)
        folder = run / "profile"
        s = prof.write(folder, title=f"kiln {self.config.model} {self.config.precision} on {self.device}, "
                                     f"steps {first}-{self.step}")
        tokens = self.config.batch_size * self.seq_len * self.config.grad_accum
        overhead = {"plain_step_ms": 1e3 * float(np.median(plain)) if plain else None,
                    "profiled_step_ms": 1e3 * float(np.median(profiled)), "plain_steps": len(plain),
                    "profiled_steps": len(profiled), "model_flops_per_step": gpt_flops_per_token(
                        self.model_config, self.seq_len) * tokens, "kernel_flops_per_step": s["flops"] / len(profiled)}
        if plain:
            overhead["overhead"] = overhead["profiled_step_ms"] / overhead["plain_step_ms"] - 1
        (folder / "overhead.json").write_text(json.dumps(overhead, indent=1))
        table = f"{len(profiled)} steps from step {first}\n" + prof.table()
        if plain:
            table += (f"\nprofiler overhead: {overhead['profiled_step_ms']:.1f} ms per profiled step vs "
                      f"{overhead['plain_step_ms']:.1f} plain ({100 * overhead['overhead']:+.1f}%)")
        print(table, flush=True)
        return row

    def save_weights(self, path: Path) -> None:
        save_weights(path, self.dense_model)

    def _gather_for_writing(self) -> None:
        """On every rank at the end of a run, so that rank 0 alone can write the weights and sample
        (a forward) with no collective: FSDP's full parameters; tp/cp's dense model (on rank 0)."""
        from kiln.distributed import FullyShardedDataParallel
        if isinstance(self.ddp, FullyShardedDataParallel):
            self.ddp.summon_full_parameters()
        if self.model_parallel is not None:
            state = self.model_parallel.dense_state_dict()  # collective over tp
            if self.rank == 0:
                dense = GPT(self.model_config, generator=kiln.Generator(self.config.seed))
                dense.to(self.device, dtype=self.parameter_dtype)
                dense.load_state_dict(state)
                apply_precision(dense, self.config.precision, self.device, self.config.bf16_residual)
                self.dense_model = dense

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The whole training state, arrays live (not copies): parameters, AdamW moments and step,
        the trainer's step and epoch, both loaders' positions, every RNG state, the last loss and
        the configs (paper, Appendix B.14: "parameters, optimizer moments, RNG state, step, epoch,
        and loss")."""
        from kiln.random import default_generator
        names = {id(p): n for n, p in self.model.named_parameters()}
        model = optimizer = None  # ZeRO/FSDP: parameters and moments go to each rank's shard file
        if self.model_parallel is not None:  # the dense model's state (collective): loads into any layout
            model, optimizer = self.model_parallel.dense_state()
        elif not self.sharded:
            model = {n: p.data for n, p in self.model.named_parameters()}
            optimizer = self.optimizer.state_dict()
            optimizer["params"] = [names[id(p)] for p in self.optimizer.params]
        devices = sorted({"cpu", str(self.device)})
        return {"kind": "kiln.Trainer", "kiln": kiln.__version__, "step": self.step,
                "epoch": self.train_loader.state_dict()["epoch"], "last_loss": self.last_loss,
                "device": str(self.device), "precision": self.config.precision,
                "model": model,
                "optimizer": optimizer,
                "loaders": {"train": self.train_loader.state_dict(), "val": self.val_loader.state_dict()},
                "rng": {"default": {d: default_generator(d).get_state() for d in devices},
                        "sample": self.sample_rng.bit_generator.state},
                "config": {"train": jsonable(dataclasses.asdict(self.config)),
                           "model": dataclasses.asdict(self.model_config)}}

    def load_state_dict(self, state: dict, shards=None) -> None:
        """Continue from `state_dict()`'s state, onto this trainer's device (cpu <-> cuda works; bit
        for bit on the same device and precision). A checkpoint of another model or data is a
        CheckpointError that names the difference."""
        from kiln.checkpoint import CheckpointError
        from kiln.errors import KilnError
        from kiln.random import default_generator
        if not isinstance(state, dict) or state.get("kind") != "kiln.Trainer":
            raise CheckpointError(f"not a Trainer checkpoint (kind {state.get('kind') if isinstance(state, dict) else state!r})")
        saved, mine = state["config"]["model"], dataclasses.asdict(self.model_config)
        if saved != mine:
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            raise CheckpointError(f"the checkpoint's model config does not match this model: "
                                  f"{diff} (checkpoint, this model)")
        names = [n for n, _ in self.model.named_parameters()]
        order = {id(p): n for n, p in self.model.named_parameters()}
        if state["model"] is None:  # a sharded checkpoint: the arrays are in the shard files
            if shards is None:
                raise CheckpointError("this state's parameters are in a sharded checkpoint's shard files; "
                                      "resume it with Trainer.from_checkpoint")
        elif state["optimizer"].get("params") != [order[id(p)] for p in self.adamw.params]:
            raise CheckpointError("the checkpoint's optimizer holds other parameters than this model's "
                                  f"({len(state['optimizer'].get('params') or [])} vs {len(names)})")
        if self._graph_step is not None:  # the graph would keep updating the old buffers
            self._graph_step.release()
            self._graph_step = None
        try:
            if state["model"] is None and self.model_parallel is not None:  # a zero/fsdp run's shards, read whole
                from kiln.distributed.checkpoint import read_replicated
                self.model_parallel.load_dense_state(*read_replicated(shards, self.adamw, order))
            elif state["model"] is None:
                from kiln.distributed.checkpoint import load_sharded
                load_sharded(shards, self.model, self.adamw, self.ddp, self.group)
            elif self.model_parallel is not None:  # this rank's shards of the dense state
                self.model_parallel.load_dense_state(state["model"], state["optimizer"])
            elif self.sharded:  # a one-process or DDP run's single file, each rank keeping its shards
                from kiln.distributed.checkpoint import load_replicated
                load_replicated(state["model"], state["optimizer"], self.model, self.adamw, self.ddp, self.group)
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            self.train_loader.load_state_dict(state["loaders"]["train"])
            self.val_loader.load_state_dict(state["loaders"]["val"])
        except CheckpointError:
            raise
        except KilnError as e:
            raise CheckpointError(f"cannot continue from this checkpoint: {e}") from e
        self.step, self.last_loss = int(state["step"]), state["last_loss"]
        restored = set()
        for name, rng_state in state["rng"]["default"].items():
            dev = parse_device(name)
            if dev.type == "cpu" or dev == self.device:
                default_generator(dev).set_state(rng_state)
                restored.add(dev)
        if self.device not in restored:  # from another device type: its RNG cannot carry over
            default_generator(self.device).manual_seed(self.config.seed + self.step)
        self.sample_rng.bit_generator.state = state["rng"]["sample"]

    @classmethod
    def from_checkpoint(cls, run_dir, report=None, **overrides) -> Trainer:
        """A Trainer that continues the run in run_dir from its newest good checkpoint (a corrupt
        newest one is reported and the previous good one used). overrides may change RESUME_OVERRIDES."""
        from kiln.checkpoint import CheckpointError, CheckpointFolder
        run = Path(run_dir)
        if not (run / "checkpoints").is_dir():
            raise CheckpointError(f"{run} is not a kiln run folder with checkpoints (no {run / 'checkpoints'})")
        bad = sorted(set(overrides) - set(RESUME_OVERRIDES))
        if bad:
            raise ConfigError(f"a resumed run keeps its checkpoint's settings; {bad} cannot change; "
                              f"allowed: {', '.join(RESUME_OVERRIDES)}")
        state, path = CheckpointFolder(run / "checkpoints").load_latest(report)
        shards = None
        if "sharded" in state:  # a zero/fsdp run's manifest: the trainer's state, shards named
            state, shards = state["state"], path
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        train = {k: v for k, v in state["config"]["train"].items() if k in fields}
        train.update(overrides, init_from=None, betas=tuple(train["betas"]),
                     model_overrides=state["config"]["model"])  # the checkpoint fixes the model
        trainer = cls(TrainConfig(**train))
        trainer.load_state_dict(state, shards)
        trainer.run_dir, trainer.resumed_from = run, path
        return trainer

    def save_checkpoint(self, checkpoints, saver=None) -> int:
        """Save the state as checkpoints/ckpt-<step>.kiln, in the background when a saver is given
        (the step waits only while its copy to host memory is queued); returns the step saved."""
        from kiln.checkpoint import save
        from kiln.checkpoint.async_save import to_host
        t0 = time.perf_counter()
        if self.shard_files:  # collective: each rank writes its own shard, rank 0 the manifest
            from kiln.distributed.checkpoint import save_sharded
            save_sharded(checkpoints.path_for(self.step), self.model, self.adamw, self.ddp, self.group,
                         state=to_host(self.state_dict()), on_saved=checkpoints.commit)
            self.checkpoint_stalls.append(time.perf_counter() - t0)
            return self.step
        state = self.state_dict()  # tp/cp: the dense state, gathered on every rank (collective)
        if self.rank != 0:  # tp/cp: rank 0 alone writes it
            return self.step
        path = checkpoints.path_for(self.step)
        if saver is not None:
            saver.save(path, state, on_done=checkpoints.commit)
        else:
            checkpoints.commit(save(path, to_host(state)))
        self.checkpoint_stalls.append(time.perf_counter() - t0)
        return self.step

    def _checkpointing(self, run: Path):
        """(folder, saver or None, the step already saved: this one) for fit()."""
        from kiln.checkpoint import AsyncSaver, CheckpointFolder
        checkpoints = CheckpointFolder(run / "checkpoints", self.config.keep_checkpoints)
        checkpoints.prepare()
        # ZeRO/FSDP checkpoints are written by every rank together, synchronously
        async_save = self.config.async_checkpoint and not self.shard_files
        return checkpoints, AsyncSaver() if async_save else None, self.step

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """SIGINT/SIGTERM during fit() finish the step, save and return; a second SIGINT raises
        KeyboardInterrupt at once (the previous checkpoint stays: saves are atomic)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signum

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
