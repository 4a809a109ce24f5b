"""`Trainer(tp=..., cp=...)` on every rank (argv: out_dir, tp, cp, parallel, batch_size, max_steps, dropout,
cp_transport, tp_chunks); rank 0 writes the run folder, every rank helps gather its dense checkpoints."""

import sys

from rank_output import write_result

from kiln.train import TrainConfig, Trainer

out, tp, cp, parallel, batch, steps, dropout, transport, chunks = (
    sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]),
    float(sys.argv[7]), sys.argv[8], int(sys.argv[9]))
trainer = Trainer(TrainConfig(model_overrides={"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32,
                                               "dropout": dropout},
                              precision="fp64", batch_size=batch, seq_len=32, global_batch=4 * 32 * 2, max_steps=steps,
                              eval_interval=2, eval_iters=3, sample_tokens=10, device="cpu", progress=False,
                              out_dir=out, run_name="run", parallel=parallel, bucket_mb=0.02, warmup_steps=1,
                              checkpoint_interval=2, tp=tp, cp=cp, cp_transport=transport, tp_chunks=chunks))
summary = trainer.fit()
write_result(trainer.rank, {"summary": {k: v for k, v in summary.items() if k != "sample"},
                            "coordinate": trainer.mesh.coordinate, "grad_accum": trainer.grad_accum,
                            "replicas": trainer.replicas, "step": trainer.step,
                            "data_parallel": type(trainer.ddp).__name__})
