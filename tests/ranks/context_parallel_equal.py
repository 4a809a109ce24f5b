"""Context-parallel attention on W ranks against full causal attention on one, each transport,
with and without the zigzag load balance, float64 and float32: the largest difference of the
output and of dq, dk, dv (each rank's tokens against the same tokens of the full result)."""

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.distributed.context_parallel import (
    TRANSPORTS,
    context_parallel_attention,
    shard_sequence,
)
from kiln.nn import functional as F

world = dist.init_process_group("mpi", timeout=60)
W, r = world.size, world.rank
B, H, T, D = 2, 2 * W, 8 * W, 8
errors = {}
for dtype in ("float64", "float32"):
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((B, H, T, D)).astype(dtype) for _ in range(4))
    full = [kiln.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*full)
    (out * kiln.tensor(g)).sum().backward()
    want = [out.numpy()] + [a.grad.numpy() for a in full]
    for transport in TRANSPORTS:
        for zigzag in (False, True):
            mine = [kiln.tensor(shard_sequence(a, r, W, zigzag, axis=2), requires_grad=True) for a in (q, k, v)]
            y = context_parallel_attention(*mine, world, transport, zigzag)
            (y * kiln.tensor(shard_sequence(g, r, W, zigzag, axis=2))).sum().backward()
            got = [y.numpy()] + [a.grad.numpy() for a in mine]
            errors[f"{dtype}/{transport}/{'zigzag' if zigzag else 'contiguous'}"] = [
                float(np.max(np.abs(a - shard_sequence(b, r, W, zigzag, axis=2)))) for a, b in zip(got, want)]
write_result(r, errors)
