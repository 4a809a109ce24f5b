"""Tensor parallelism on W ranks against the dense layers and GPT, in float64.

Every rank builds the dense reference itself (same seeds), runs the TP version on its shards and
reports the largest difference of each output and gradient (a TP gradient against the same shard
of the dense one), the async-TP runs (N = 2, 4) against plain TP, and the all-reduces of one
block's forward (count and element count) seen by the tp group."""

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    dense_state_dict,
    parallelize_tensor,
    shard,
    shard_layout,
)
from kiln.nn import GPT, Embedding, GPTConfig, Linear, functional as F

world = dist.init_process_group("mpi", timeout=60)
W, r = world.size, world.rank
tp = world  # the whole world is one tp group here
rng = np.random.default_rng(5)
errors = {}


def diff(name, got, want):
    errors[name] = max(errors.get(name, 0.0), float(np.max(np.abs(np.asarray(got) - np.asarray(want)))))


def t(a, grad=False):
    return kiln.tensor(np.array(a), requires_grad=grad)


B, T, C = 2, 8, 16
x = rng.standard_normal((B, T, C))
# ---- column-parallel (packed q|k|v: 3 sections), with its f
dense = Linear(C, 3 * C, generator=kiln.Generator(1)).to(dtype="float64")
with kiln.no_grad():
    dense.bias.copy_(kiln.tensor(rng.standard_normal(3 * C)))
gy = rng.standard_normal((B, T, 3 * C))
xd = t(x, True)
(dense(xd) * t(gy)).sum().backward()
col = ColumnParallelLinear(dense, tp, sections=3)
xc = t(x, True)
yc = col(xc)
diff("column_out", yc.numpy(), shard(dense(t(x)).numpy(), 2, 3, r, W))
(yc * t(shard(gy, 2, 3, r, W))).sum().backward()
diff("column_dx", xc.grad.numpy(), xd.grad.numpy())
diff("column_dw", col.weight.grad.numpy(), shard(dense.weight.grad.numpy(), 0, 3, r, W))
diff("column_db", col.bias.grad.numpy(), shard(dense.bias.grad.numpy(), 0, 3, r, W))

# ---- row-parallel, its g, async chunks 1, 2, 4
dense = Linear(4 * C, C, generator=kiln.Generator(2)).to(dtype="float64")
with kiln.no_grad():
    dense.bias.copy_(kiln.tensor(rng.standard_normal(C)))
h = rng.standard_normal((B, T, 4 * C))
gy = rng.standard_normal((B, T, C))
hd = t(h, True)
(dense(hd) * t(gy)).sum().backward()
for chunks in (1, 2, 4):
    row = RowParallelLinear(dense, tp, chunks)
    hr = t(shard(h, 2, 1, r, W), True)
    yr = row(hr)
    diff(f"row_out_{chunks}", yr.numpy(), dense(t(h)).numpy())
    (yr * t(gy)).sum().backward()
    diff(f"row_dx_{chunks}", hr.grad.numpy(), shard(hd.grad.numpy(), 2, 1, r, W))
    diff(f"row_dw_{chunks}", row.weight.grad.numpy(), shard(dense.weight.grad.numpy(), 1, 1, r, W))
    diff(f"row_db_{chunks}", row.bias.grad.numpy(), dense.bias.grad.numpy())
    row.bias.grad = None  # the bias is the dense one's (replicated), shared with the next run

# ---- vocabulary-parallel embedding and cross-entropy
V = 8 * W
dense = Embedding(V, C, generator=kiln.Generator(3)).to(dtype="float64")
idx = rng.integers(0, V, (B, T))
ge = rng.standard_normal((B, T, C))
(dense(t(idx)) * t(ge)).sum().backward()
emb = VocabParallelEmbedding(dense, tp)
ye = emb(t(idx))
diff("embedding_out", ye.numpy(), dense(t(idx)).numpy())
(ye * t(ge)).sum().backward()
diff("embedding_dw", emb.weight.grad.numpy(), shard(dense.weight.grad.numpy(), 0, 1, r, W))
logits = rng.standard_normal((B * T, V)) * 3
targets = rng.integers(0, V, B * T)
targets[3] = -100  # an ignored row
ld = t(logits, True)
loss_d = F.cross_entropy(ld, t(targets))
loss_d.backward()
lp = t(shard(logits, 1, 1, r, W), True)
loss_p = VocabParallelCrossEntropy.apply(lp, t(targets), tp, r * (V // W), -100)
diff("cross_entropy_loss", loss_p.item(), loss_d.item())
loss_p.backward()
diff("cross_entropy_dlogits", lp.grad.numpy(), shard(ld.grad.numpy(), 1, 1, r, W))

# ---- the whole GPT, plain TP and async TP, and the collectives of one block
cfg = GPTConfig(vocab_size=16 * W, block_size=16, n_layer=2, n_head=2 * W, n_embd=8 * W)
idx = rng.integers(0, cfg.vocab_size, (2, 16))
tgt = rng.integers(0, cfg.vocab_size, (2, 16))


def dense_gpt():
    m = GPT(cfg, generator=kiln.Generator(11)).to(dtype="float64")
    with kiln.no_grad():  # biases and LayerNorms away from their 0/1 start, so their gradients are tested
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(kiln.tensor(np.random.default_rng(len(name)).standard_normal(p.shape) * 0.1))
    return m


ref = dense_gpt()
ref_loss = ref(t(idx), t(tgt))[1]  # with targets the dense head is fused: no logits
ref_logits = ref(t(idx))[0]
ref_loss.backward()
ref_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
losses = {}
calls = []
count = tp.all_reduce


def counting(tensor, *args, **kwargs):
    calls.append(tensor.numel())
    return count(tensor, *args, **kwargs)


def diff_grads(model, name):
    """Each TP gradient against its shard of the dense model's."""
    layout = shard_layout(model)
    for pname, p in model.named_parameters():
        axis, sections = layout.get(pname, (None, None))
        want = ref_grads[pname] if axis is None else shard(ref_grads[pname], axis, sections, r, W)
        diff(name, p.grad.numpy(), want)


for chunks in (1, 2, 4):
    model = parallelize_tensor(dense_gpt(), tp, chunks)
    logits, loss = model(t(idx), t(tgt))
    losses[chunks] = loss.item()
    diff("gpt_loss", loss.item(), ref_loss.item())
    diff("gpt_logits", logits.numpy(), shard(ref_logits.numpy(), 2, 1, r, W))
    loss.backward()
    diff_grads(model, "gpt_grads" if chunks == 1 else "gpt_grads_async")
    state = dense_state_dict(model, tp)
    diff("gpt_dense_state", max(float(np.max(np.abs(state[n] - p.numpy()))) for n, p in ref.named_parameters()), 0)
    # one block's forward: Megatron's two all-reduces (attention and MLP outputs), N pieces each in async TP
    tp.all_reduce = counting
    calls.clear()
    block = model.h[0]
    block(t(rng.standard_normal((2, 16, cfg.n_embd))))
    tp.all_reduce = count
    errors[f"block_all_reduces_{chunks}"] = list(calls)
diff("async_tp_loss_vs_plain", max(abs(losses[n] - losses[1]) for n in losses), 0)

# ---- the same with Block.recompute_norm_gelu: c_attn and c_fc keep the residual (f before them), the
# MLP's c_proj keeps the pre-activation and makes the GELU again (g after it, in N pieces)
for chunks in (1, 2):
    model = parallelize_tensor(dense_gpt(), tp, chunks)
    model.recompute_norm_gelu = True
    loss = model(t(idx), t(tgt))[1]
    diff("gpt_loss_recompute", loss.item(), ref_loss.item())
    loss.backward()
    diff_grads(model, "gpt_grads_recompute")

# ---- the new core collectives: send_recv around the ring, all_to_all
a = np.arange(6, dtype=np.float64) + 100 * r
buf = kiln.tensor(np.empty(6))
tp.send_recv(kiln.tensor(a), (r + 1) % W, buf, (r - 1) % W)
diff("send_recv", buf.numpy(), np.arange(6) + 100 * ((r - 1) % W))
send = np.arange(3 * W, dtype=np.float64) + 1000 * r
out = kiln.tensor(np.empty(3 * W))
tp.all_to_all(out, kiln.tensor(send))
diff("all_to_all", out.numpy(), np.concatenate([np.arange(3 * r, 3 * r + 3) + 1000 * j for j in range(W)]))
write_result(r, errors)
