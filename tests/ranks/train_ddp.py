"""`Trainer(parallel="ddp")` on every rank (argv: out_dir); rank 0 writes the run folder."""

import sys

from rank_output import write_result

from kiln.train import TrainConfig, Trainer

cfg = TrainConfig(model_overrides={"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32}, precision="fp64",
                  batch_size=4 // int(sys.argv[2]), seq_len=32, global_batch=4 * 32 * 2, max_steps=4,
                  eval_interval=2, eval_iters=3, sample_tokens=10, device="cpu", progress=False,
                  out_dir=sys.argv[1], run_name="ddp", parallel="ddp", bucket_mb=0.02, warmup_steps=1)
trainer = Trainer(cfg)
summary = trainer.fit()
write_result(trainer.rank, {"summary": {k: v for k, v in summary.items() if k != "sample"},
                            "grad_accum": trainer.grad_accum, "world_size": trainer.world_size})
