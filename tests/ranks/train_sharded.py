"""`Trainer(parallel=...)` on every rank, from scratch or resumed (argv: out_dir, parallel, max_steps,
batch_size, resume: 0/1); rank 0 writes the run folder, every rank its checkpoint shard."""

import sys

from rank_output import write_result

from kiln.train import TrainConfig, Trainer

out, parallel, steps, batch, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
if resume:
    trainer = Trainer.from_checkpoint(f"{out}/run", max_steps=steps, parallel=parallel, batch_size=batch)
else:
    trainer = Trainer(TrainConfig(model_overrides={"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32},
                                  precision="fp64", batch_size=batch, seq_len=32, global_batch=4 * 32 * 2, max_steps=steps,
                                  eval_interval=2, eval_iters=3, sample_tokens=10, device="cpu", progress=False,
                                  out_dir=out, run_name="run", parallel=parallel, bucket_mb=0.02, warmup_steps=1,
                                  checkpoint_interval=2))
summary = trainer.fit()
write_result(trainer.rank, {"summary": {k: v for k, v in summary.items() if k != "sample"},
                            "world_size": trainer.world_size, "step": trainer.step})
