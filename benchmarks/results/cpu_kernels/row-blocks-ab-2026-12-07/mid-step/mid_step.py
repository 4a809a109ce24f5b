"""A mid-size GPT's CPU step (6 layers, 768 wide, 12 heads, T1024, B2, vocab 320), fp32: median ms of 3 steps after 1."""
import json
import time

import numpy as np

import kiln
from kiln.nn import GPT, preset
from kiln.optim import AdamW, clip_grad_norm_, gpt_param_groups

cfg = preset("tiny", vocab_size=320, n_layer=6, n_embd=768, n_head=12, block_size=1024)
model = GPT(cfg, generator=kiln.Generator(0))
opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95))
rng = np.random.default_rng(0)
ts, losses = [], []
for i in range(4):
    x = rng.integers(0, 320, (2, 1024)); y = rng.integers(0, 320, (2, 1024))
    t0 = time.perf_counter()
    opt.zero_grad(); _, loss = model(kiln.tensor(x), kiln.tensor(y)); loss.backward()
    clip_grad_norm_(model.parameters(), 1.0); opt.step(); losses.append(loss.item())
    ts.append(time.perf_counter() - t0)
    if i == 0: model.wte.weight.backend.end_warmup()
print(json.dumps({"median_step_ms": 1000 * float(np.median(ts[1:])), "losses": losses}))
