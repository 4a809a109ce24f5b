"""The fused LM head (F.lm_head_cross_entropy): against the unfused linear + cross_entropy in
float64 on the CPU, in chunks of every size; its GPU kernels against the CPU reference (cuda);
and a short GPU training run twice, bit for bit (cuda)."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.backend.cpu import lm_head as cpu_lm_head
from kiln.errors import AutogradError, DTypeError, ShapeError
from kiln.nn import functional as F
from tests.conftest import rel

BF16 = np.dtype(ml_dtypes.bfloat16)
needs_gpu = pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU with CuPy")


def problem(rng, n=37, c=24, v=53, ignore=5):
    x = rng.standard_normal((n, c))
    w = rng.standard_normal((v, c)) * 0.5
    t = rng.integers(0, v, n)
    t[rng.choice(n, ignore, replace=False)] = -100
    return x, w, t


def unfused(x, w, t, scale=1.0, dtype="float64"):
    """(loss, dx, dw) through F.linear and F.cross_entropy: the reference."""
    xt = kiln.tensor(x).to(dtype).requires_grad_()
    wt = kiln.tensor(w).to(dtype).requires_grad_()
    loss = F.cross_entropy(F.linear(xt, wt), kiln.tensor(t))
    (loss * scale).backward()
    return loss.item(), xt.grad.numpy(), wt.grad.numpy()


@pytest.mark.parametrize("chunk", [1, 7, 36, 37, None])
def test_fused_head_matches_linear_and_cross_entropy_in_float64(chunk):
    rng = np.random.default_rng()
    x, w, t = problem(rng)
    ref_loss, ref_dx, ref_dw = unfused(x, w, t, scale=2.5)
    xt = kiln.tensor(x).requires_grad_()
    wt = kiln.tensor(w).requires_grad_()
    loss = F.lm_head_cross_entropy(xt, wt, kiln.tensor(t), chunk_rows=chunk)
    (loss * 2.5).backward()  # the upstream gradient scales both grads
    assert abs(loss.item() - ref_loss) <= 1e-12 * abs(ref_loss)
    assert rel(xt.grad.numpy(), ref_dx) <= 1e-12
    assert rel(wt.grad.numpy(), ref_dw) <= 1e-12


def test_fused_head_keeps_leading_axes_and_float32():
    rng = np.random.default_rng()
    x, w, t = problem(rng, n=24)
    ref_loss, ref_dx, ref_dw = unfused(x, w, t)
    xt = kiln.tensor(x.reshape(2, 12, -1)).to("float32").requires_grad_()
    wt = kiln.tensor(w).to("float32").requires_grad_()
    loss = F.lm_head_cross_entropy(xt, wt, kiln.tensor(t.reshape(2, 12)), chunk_rows=5)
    loss.backward()
    assert loss.dtype is kiln.float32 and xt.grad.shape == (2, 12, x.shape[1])
    assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss)
    assert rel(xt.grad.numpy().reshape(x.shape), ref_dx) <= 1e-5
    assert rel(wt.grad.numpy(), ref_dw) <= 1e-5


def test_fused_head_bf16_is_within_bf16_rounding():
    rng = np.random.default_rng()
    x, w, t = problem(rng, n=64, c=32, v=97)
    ref_loss, ref_dx, ref_dw = unfused(x, w, t)
    xt = kiln.tensor(x).to("bfloat16").requires_grad_()
    wt = kiln.tensor(w).to("bfloat16").requires_grad_()
    loss = F.lm_head_cross_entropy(xt, wt, kiln.tensor(t), chunk_rows=16)
    loss.backward()
    assert xt.grad.dtype is kiln.bfloat16 and wt.grad.dtype is kiln.bfloat16
    assert abs(loss.item() - ref_loss) <= 1e-2 * abs(ref_loss)
    assert rel(xt.grad.numpy(), ref_dx) <= 2e-2
    assert rel(wt.grad.numpy(), ref_dw) <= 2e-2


def test_all_targets_ignored_gives_nan_as_cross_entropy_does():
    x, w, t = problem(np.random.default_rng(), n=4, ignore=4)
    loss = F.lm_head_cross_entropy(kiln.tensor(x), kiln.tensor(w), kiln.tensor(t))
    assert np.isnan(loss.item())


def test_bad_inputs_are_clear_errors():
    x, w, t = problem(np.random.default_rng())
    with pytest.raises(DTypeError, match="share a floating dtype"):
        F.lm_head_cross_entropy(kiln.tensor(x).to("float32"), kiln.tensor(w), kiln.tensor(t))
    with pytest.raises(DTypeError, match="integer class indices"):
        F.lm_head_cross_entropy(kiln.tensor(x), kiln.tensor(w), kiln.tensor(t.astype(np.float64)))
    with pytest.raises(ShapeError, match="do not fit"):
        F.lm_head_cross_entropy(kiln.tensor(x), kiln.tensor(w[:, :5]), kiln.tensor(t))
    with pytest.raises(ShapeError, match="chunk_rows"):
        F.lm_head_cross_entropy(kiln.tensor(x), kiln.tensor(w), kiln.tensor(t), chunk_rows=0)
    with pytest.raises(kiln.KilnError, match="outside the vocabulary"):
        F.lm_head_cross_entropy(kiln.tensor(x), kiln.tensor(w), kiln.tensor(np.full(len(t), 99)))


def test_a_retained_graph_gives_the_same_gradients_again_and_then_a_clear_error():
    x, w, t = problem(np.random.default_rng())
    xt, wt = kiln.tensor(x).requires_grad_(), kiln.tensor(w).requires_grad_()
    loss = F.lm_head_cross_entropy(xt, wt, kiln.tensor(t))
    loss.backward(retain_graph=True)
    first = (xt.grad.numpy().copy(), wt.grad.numpy().copy())
    xt.grad = wt.grad = None
    loss.backward()
    np.testing.assert_array_equal(xt.grad.numpy(), first[0])
    np.testing.assert_array_equal(wt.grad.numpy(), first[1])
    with pytest.raises(AutogradError, match="a second time"):
        loss.backward()


def test_loss_backward_of_the_head_skips_the_scale_by_the_implicit_one(monkeypatch):
    """loss.backward() hands the head its implicit gradient 1 as such (autograd.is_unit_grad): the backend is
    asked to scale by nothing, and the gradients are those of backward(1.0), which scales; 2.0 doubles them."""
    be = kiln.backend.get_backend("cpu")
    seen = []
    real = be.lm_head_xent_bwd
    monkeypatch.setattr(be, "lm_head_xent_bwd", lambda g, *a: seen.append(g) or real(g, *a))
    x, w, t = problem(np.random.default_rng())
    grads = []
    for upstream in (None, 1.0, 2.0):
        xt, wt = kiln.tensor(x).requires_grad_(), kiln.tensor(w).requires_grad_()
        loss = F.lm_head_cross_entropy(xt, wt, kiln.tensor(t))
        loss.backward(None if upstream is None else kiln.tensor(upstream))
        grads.append((xt.grad.numpy(), wt.grad.numpy()))
    assert seen[0] is None and all(g is not None for g in seen[1:])
    for a, b, c in zip(*grads):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(2 * a, c)


def test_chunks_fit_the_budget_and_cover_the_rows():
    rows = cpu_lm_head.chunk_rows_for(16384, 50304, 2)
    assert rows == 4096  # 4 chunks of 412 MB of bf16 logits for GPT-2 124M at B16 T1024
    assert rows * 50304 * 2 <= cpu_lm_head.CHUNK_BYTES
    assert cpu_lm_head.chunk_rows_for(10, 7, 4) == 10


def test_the_cross_entropy_kernel_keeps_a_row_in_shared_memory_where_two_fit_an_sm(monkeypatch):
    """GPT-2's 50304 bf16 logits (100.6 KB) are kept on an H100 (228 KB an SM, 227 KB a block); its fp32
    logits (201 KB) fit one block but not two, and the kernel reads those rows twice instead."""
    from kiln.backend.cuda import cross_entropy as cuda_ce
    h100 = {"MaxSharedMemoryPerBlockOptin": 232448, "MaxSharedMemoryPerMultiprocessor": 233472}
    monkeypatch.setattr(cuda_ce.rt, "attribute", h100.__getitem__)
    assert cuda_ce.kept_row_bytes(50304, 2) == 100608
    assert cuda_ce.kept_row_bytes(50304, 4) == 0
    assert cuda_ce.kept_row_bytes(1001, 4) == 4004


# --- on the GPU ---------------------------------------------------------------------------


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (BF16, 1e-2), (np.float16, 2e-3)],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("v", [4096, 1001, 50304])  # 1001: not a multiple of the 16-byte pack; 50304: GPT-2's
@pytest.mark.parametrize("tdtype", [np.int64, np.int32])
@pytest.mark.parametrize("kept", [False, True], ids=["row-read-twice", "row-kept"])
def test_cuda_fused_cross_entropy_kernel_matches_the_cpu_reference(dtype, tol, v, tdtype, kept):
    """One launch: per-row losses and validity, and dlogits written over the logits in place; with the
    row kept in shared memory between its two passes (the launch's dynamic shared memory holds it) the
    same bits as reading it twice."""
    from kiln.backend.cpu import cross_entropy as cpu_ce
    from kiln.backend.cuda.device import cupy
    from kiln.backend.cuda.launch import ctype, get_kernel, i32, i64, idx_ctype
    cp = cupy()
    rng = np.random.default_rng()
    n = 67
    logits = (rng.standard_normal((n, v)) * 3).astype(dtype)
    t = rng.integers(0, v, n).astype(tdtype)
    t[::5] = -100
    t[1] = v - 1  # the last logit of a row
    valid = t != -100
    scale = 1.0 / valid.sum()
    gpu = kiln.device("cuda").backend

    def launch(shared_mem):
        buf = gpu.asarray(logits)
        rows = cp.full((2 * n,), np.nan, dtype=cp.float32)
        get_kernel("cross_entropy.cu", f"cross_entropy_fused<{ctype(logits.dtype)}, {idx_ctype(t.dtype)}>")(
            (n,), (512,), (buf, cp.asarray(t), rows, rows[n:], cp.asarray(np.float32(scale)), i32(v), i64(-100)),
            shared_mem=shared_mem)
        return buf, rows

    buf, rows = launch(v * logits.itemsize if kept else 0)
    if kept:  # bit for bit what reading the row twice gives
        twice, twice_rows = launch(0)
        np.testing.assert_array_equal(gpu.to_numpy(buf).view(np.uint8), gpu.to_numpy(twice).view(np.uint8))
        np.testing.assert_array_equal(cp.asnumpy(rows), cp.asnumpy(twice_rows))
    ref_loss, lse = cpu_ce.cross_entropy_fwd(logits.astype(np.float64), t, -100)
    ref_rows = np.where(valid, lse - logits.astype(np.float64)[np.arange(n), np.where(valid, t, 0)], 0.0)
    got_rows = cp.asnumpy(rows)
    assert rel(got_rows[:n], ref_rows) <= 1e-5
    np.testing.assert_array_equal(got_rows[n:], valid.astype(np.float32))
    ref_d = cpu_ce.cross_entropy_bwd(np.float64(1.0), logits.astype(np.float64), t, lse, -100)
    got_d = gpu.to_numpy(buf).astype(np.float64)
    assert rel(got_d, ref_d) <= tol
    assert (got_d[~valid] == 0).all()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("chunk", [13, 64, None])
def test_cuda_fused_head_matches_the_cpu_reference(dtype, tol, chunk):
    rng = np.random.default_rng()
    x, w, t = problem(rng, n=100, c=64, v=1000, ignore=9)
    ref_loss, ref_dx, ref_dw = unfused(x, w, t, scale=0.75)
    dev = kiln.device("cuda")
    xt = kiln.tensor(x).to(dtype).to(dev).requires_grad_()
    wt = kiln.tensor(w).to(dtype).to(dev).requires_grad_()
    loss = F.lm_head_cross_entropy(xt, wt, kiln.tensor(t, device=dev), chunk_rows=chunk)
    (loss * 0.75).backward()
    assert abs(loss.item() - ref_loss) <= tol * abs(ref_loss)
    assert rel(xt.grad.to("float32").numpy(), ref_dx) <= tol
    assert rel(wt.grad.to("float32").numpy(), ref_dw) <= tol
    # the same chunks on the CPU backend: the GPU follows the reference's roundings closely
    c_loss, c_dx, c_dw = cpu_lm_head.lm_head_xent_fwd(
        kiln.tensor(x).to(dtype).numpy(), kiln.tensor(w).to(dtype).numpy(), t, -100, chunk)
    g_loss, g_dx, g_dw = dev.backend.lm_head_xent_fwd(xt.data, wt.data, kiln.tensor(t, device=dev).data, -100, chunk)
    assert abs(float(g_loss) - float(c_loss)) <= 1e-5 * abs(float(c_loss))
    assert rel(dev.backend.to_numpy(g_dx).astype(np.float64), c_dx.astype(np.float64)) <= tol / 2
    assert rel(dev.backend.to_numpy(g_dw), c_dw) <= (1e-5 if dtype == "float32" else 1e-2)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_training_is_bitwise_reproducible(precision):
    """Two fresh GPT runs with one seed and the same batches give bit-equal losses and parameters
    (the fused LM head's dweight is summed over chunks in the GEMM, in a fixed order)."""
    from kiln.nn import GPT, preset
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision
    rng = np.random.default_rng()
    batches = [(rng.integers(0, 512, (4, 64)), rng.integers(0, 512, (4, 64))) for _ in range(4)]

    def run():
        dev = kiln.device("cuda")
        model = GPT(preset("tiny", vocab_size=512, block_size=64, n_layer=2), generator=kiln.Generator(7)).to(dev)
        apply_precision(model, precision, dev)
        opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-3)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            _, loss = model(kiln.tensor(x, device=dev), kiln.tensor(y, device=dev))
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            losses.append(loss.item())
        return losses, [p.numpy().copy() for p in model.parameters()]

    (l1, p1), (l2, p2) = run(), run()
    assert l1 == l2
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a, b)
