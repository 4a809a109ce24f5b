// LayerNorm over the last axis of x[N, C]: forward (y, mean, rstd) and the fused backward.
// weight and bias are always real pointers (the host passes ones / zeros for a missing one),
// so the row loops carry no branches.
//
// `_reg` kernels are specialised on C (a multiple of 32 lanes x one 16-byte pack): one warp
// per row holds the row in registers, so x is read once, and the backward keeps per-lane
// dweight/dbias partial sums across the rows a block visits (no atomics: each block writes
// one partial row, and `column_sum_finish` (column_sum.cuh) sums the partials in a fixed order, so the
// result is deterministic). `_any` kernels take any C and re-read the row from global/L2.
//
// `add_layer_norm_*` fuse a residual add with the LayerNorm that follows it: the forward
// reads x and y and writes s = x + y (rounded to T, exactly what a separate add stores) and
// h = layer_norm(s); the backward is the LayerNorm backward with the gradient of s added to
// dx before it is stored (dx is then the gradient of both x and y). They share the row code
// of the plain kernels (the kAdd template flag), and dweight/dbias go through the same
// partial sums and `column_sum_finish`. The `_dy` backward also stores dx rounded to T (dy): the
// gradient of a branch y narrower than the residual, made in the pass that stores dx instead of
// by a cast kernel that reads dx back (an fp32 residual under bf16 sublayers).
//
// Every kernel is templated over R, the type of the LayerNorm's input (the residual stream x, s,
// their gradients and the affine weights), and T, the type of the sublayer side (the branch y, the
// output, its gradient g): R = T, or autocast's fp32 residual under bf16/fp16 sublayers (R = float).
// A lane takes V = 16 bytes of T at a time, so a chunk of R is one or two 16-byte packs.
#include "column_sum.cuh"

using namespace kiln;

constexpr int kLnWarps = KILN_LN_WARPS;  // rows per block in the warp-per-row kernels (from layer_norm.py)

namespace {

// Global -> shared, 16 bytes, without a trip through registers (the fused backward's ds rows).
__device__ __forceinline__ void ln_cp_async16(void* dst_shared, const void* src) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void ln_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void ln_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// V consecutive elements of E at p (16-byte aligned, V * sizeof(E) a multiple of 16) as floats.
template <typename E, int V>
__device__ __forceinline__ void ln_load(const E* __restrict__ p, float (&f)[V]) {
    constexpr int N = Pack<E>::N;
    static_assert(V % N == 0, "a chunk is whole packs");
#pragma unroll
    for (int k = 0; k < V / N; ++k) {
        const Pack<E> a = load_pack(p + k * N);
#pragma unroll
        for (int j = 0; j < N; ++j) f[k * N + j] = to_float(a.v[j]);
    }
}

// f rounded to E and stored at p.
template <typename E, int V>
__device__ __forceinline__ void ln_store(E* __restrict__ p, const float (&f)[V]) {
    constexpr int N = Pack<E>::N;
    static_assert(V % N == 0, "a chunk is whole packs");
#pragma unroll
    for (int k = 0; k < V / N; ++k) {
        Pack<E> o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = from_float<E>(f[k * N + j]);
        store_pack(p + k * N, o);
    }
}

}  // namespace

// The forward of one row per warp, the row held in registers (v): kAdd reads x and y and
// stores s = x + y rounded to T, normalising exactly the values stored (so the backward, which
// reads s, agrees with the forward); otherwise it normalises x. Writes out = normalised * w + b.
template <typename R, typename T, int C, bool kAdd>
__device__ __forceinline__ void ln_fwd_reg_row(const R* __restrict__ x, const T* __restrict__ y,
                                               const R* __restrict__ w, const R* __restrict__ b,
                                               R* __restrict__ s, T* __restrict__ out,
                                               float* __restrict__ mean, float* __restrict__ rstd,
                                               int n, float eps) {
    constexpr int V = Pack<T>::N;
    constexpr int P = C / (32 * V);
    static_assert(C % (32 * V) == 0, "C must be a multiple of 32 packs");
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kLnWarps + (threadIdx.x >> 5);
    if (row >= n) return;
    const long long off = (long long)row * C;
    float v[P][V];
    float sum = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int c0 = (p * 32 + lane) * V;
        ln_load<R, V>(x + off + c0, v[p]);
        if constexpr (kAdd) {
            float e[V];
            ln_load<T, V>(y + off + c0, e);
#pragma unroll
            for (int j = 0; j < V; ++j) v[p][j] = to_float(from_float<R>(v[p][j] + e[j]));  // s as stored
            ln_store<R, V>(s + off + c0, v[p]);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) sum += v[p][j];
    }
    const float mu = warp_sum(sum) / C;
    float q = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float d = v[p][j] - mu;
            q += d * d;
        }
    const float r = rsqrtf(warp_sum(q) / C + eps);
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int c0 = (p * 32 + lane) * V;
        float wf[V], bf[V];
        ln_load<R, V>(w + c0, wf);
        ln_load<R, V>(b + c0, bf);
#pragma unroll
        for (int j = 0; j < V; ++j) wf[j] = (v[p][j] - mu) * r * wf[j] + bf[j];
        ln_store<T, V>(out + off + c0, wf);
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// The same for any C, re-reading the row: kAdd's first pass writes s and the next two read it
// back (this thread's own stores); otherwise all three passes read x.
template <typename R, typename T, bool kAdd>
__device__ __forceinline__ void ln_fwd_any_row(const R* __restrict__ x, const T* __restrict__ y,
                                               const R* __restrict__ w, const R* __restrict__ b,
                                               R* __restrict__ s, T* __restrict__ out,
                                               float* __restrict__ mean, float* __restrict__ rstd,
                                               int n, int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kLnWarps + (threadIdx.x >> 5);
    if (row >= n) return;
    const long long off = (long long)row * C;
    const R* xr = x + off;
    R* sr = kAdd ? s + off : nullptr;
    auto at = [&](int c) -> float {
        if constexpr (kAdd) return to_float(sr[c]);
        else return to_float(xr[c]);
    };
    float sum = 0.0f;
    for (int c = lane; c < C; c += 32) {
        if constexpr (kAdd) {
            const R v = from_float<R>(to_float(xr[c]) + to_float(y[off + c]));
            sr[c] = v;
            sum += to_float(v);
        } else {
            sum += to_float(xr[c]);
        }
    }
    const float mu = warp_sum(sum) / C;
    float q = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float d = at(c) - mu;
        q += d * d;
    }
    const float r = rsqrtf(warp_sum(q) / C + eps);
    T* outr = out + off;
    for (int c = lane; c < C; c += 32) {
        outr[c] = from_float<T>((at(c) - mu) * r * to_float(w[c]) + to_float(b[c]));
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

template <typename R, typename T, int C>
__global__ void __launch_bounds__(256) layer_norm_fwd_reg(const R* __restrict__ x, const R* __restrict__ w,
                                                          const R* __restrict__ b, T* __restrict__ y,
                                                          float* __restrict__ mean, float* __restrict__ rstd,
                                                          int n, float eps) {
    ln_fwd_reg_row<R, T, C, false>(x, nullptr, w, b, nullptr, y, mean, rstd, n, eps);
}

template <typename R, typename T>
__global__ void __launch_bounds__(256) layer_norm_fwd_any(const R* __restrict__ x, const R* __restrict__ w,
                                                          const R* __restrict__ b, T* __restrict__ y,
                                                          float* __restrict__ mean, float* __restrict__ rstd,
                                                          int n, int C, float eps) {
    ln_fwd_any_row<R, T, false>(x, nullptr, w, b, nullptr, y, mean, rstd, n, C, eps);
}

// s = x + y (rounded to R) and h = layer_norm(s) (in T).
template <typename R, typename T, int C>
__global__ void __launch_bounds__(256) add_layer_norm_fwd_reg(const R* __restrict__ x, const T* __restrict__ y,
                                                              const R* __restrict__ w, const R* __restrict__ b,
                                                              R* __restrict__ s, T* __restrict__ h,
                                                              float* __restrict__ mean, float* __restrict__ rstd,
                                                              int n, float eps) {
    ln_fwd_reg_row<R, T, C, true>(x, y, w, b, s, h, mean, rstd, n, eps);
}

template <typename R, typename T>
__global__ void __launch_bounds__(256) add_layer_norm_fwd_any(const R* __restrict__ x, const T* __restrict__ y,
                                                              const R* __restrict__ w, const R* __restrict__ b,
                                                              R* __restrict__ s, T* __restrict__ h,
                                                              float* __restrict__ mean, float* __restrict__ rstd,
                                                              int n, int C, float eps) {
    ln_fwd_any_row<R, T, true>(x, y, w, b, s, h, mean, rstd, n, C, eps);
}

// dx for the rows of this block's warps, and this block's partial dweight/dbias sums in
// partial[blockIdx.x][C] and partial[gridDim.x + blockIdx.x][C] (fp32).
// kAdd: dx += ds (the gradient of the LayerNorm's input that arrives by the residual stream).
// kDy: dy = dx as stored, rounded to T (round to nearest even, what a cast of dx stores).
// The warp's row of ds goes to shared memory by cp.async as the row starts, so its latency
// overlaps the g and x loads and the reductions without holding registers: loaded into
// registers there, ptxas keeps it live across the row and the 16-bit C = 768 kernel (GPT-2
// 124M) takes 156 registers instead of 127, one block per SM instead of two; loaded where it
// is added, its latency comes after the reductions, on every row's critical path.
// Two blocks an SM for a 16-bit gradient: ptxas needs 128 registers or fewer, as it takes here, but the device
// image's ptxas took 134 for add_layer_norm_bwd_dy_reg<float, bf16, 768> (Nsight Compute, 2026-12-07): one block
// (8 warps) an SM, 62% of DRAM bandwidth, 90 us at GPT-2's 16384 x 768. fp32 gradients and rows wider than 768
// keep ptxas's choice (0: no minimum, the registers they had; held to 128 they spill).
template <typename T, int C>
constexpr int kLnBwdMinBlocks = sizeof(T) == 2 && C <= 768 ? 2 : 0;

// The row loop's stride, gridDim.x, read where it is added in the kernels held to two blocks an SM: hoisted out
// of the loop it is one more live register, and ptxas 13.0.88 spills it there (4 bytes: a local load every row
// for add_layer_norm_bwd_dy_reg<float, bf16, 768>) instead of reading the constant again; a volatile read
// stays in the loop. The other kernels keep the hoisted read (theirs do not spill, and ptxas's choices for
// the fp32 kernels move when it changes).
template <typename T, int C>
__device__ __forceinline__ int ln_bwd_grid_dim() {
    if constexpr (kLnBwdMinBlocks<T, C> > 0) {
        int v;
        asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(v));
        return v;
    } else {
        return gridDim.x;
    }
}

template <typename R, typename T, int C, bool kAdd, bool kDy>
__device__ __forceinline__ void ln_bwd_reg(const R* __restrict__ ds, const T* __restrict__ g,
                                           const R* __restrict__ x, const R* __restrict__ w,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           R* __restrict__ dx, T* __restrict__ dy, float* __restrict__ partial,
                                           int n) {
    constexpr int V = Pack<T>::N;
    constexpr int P = C / (32 * V);
    constexpr int K = V / Pack<R>::N;  // 16-byte packs of R in a lane's chunk of V elements
    static_assert(C % (32 * V) == 0, "C must be a multiple of 32 packs");
    __shared__ float sdw[C];
    __shared__ float sdb[C];
    __shared__ int4 sds[kAdd ? kLnWarps * P * 32 * K : 1];  // one row of ds per warp, a chunk per lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float adw[P][V], adb[P][V];
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int j = 0; j < V; ++j) adw[p][j] = adb[p][j] = 0.0f;
    for (int row = blockIdx.x * kLnWarps + warp; row < n; row += ln_bwd_grid_dim<T, C>() * kLnWarps) {
        const T* gr = g + (long long)row * C;
        const R* xr = x + (long long)row * C;
        const float mu = mean[row], r = rstd[row];
        if constexpr (kAdd) {
            const R* dsr = ds + (long long)row * C;
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
                for (int k = 0; k < K; ++k)
                    ln_cp_async16(&sds[((warp * P + p) * 32 + lane) * K + k],
                                  dsr + (p * 32 + lane) * V + k * Pack<R>::N);
            ln_cp_async_commit();
        }
        float gv[P][V], xh[P][V];
        float sa = 0.0f, sb = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int c0 = (p * 32 + lane) * V;
            float wf[V];
            ln_load<T, V>(gr + c0, gv[p]);
            ln_load<R, V>(xr + c0, xh[p]);
            ln_load<R, V>(w + c0, wf);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float gg = gv[p][j];
                const float xhat = (xh[p][j] - mu) * r;
                adw[p][j] += gg * xhat;
                adb[p][j] += gg;
                const float gw = gg * wf[j];
                gv[p][j] = gw;
                xh[p][j] = xhat;
                sa += gw;
                sb += gw * xhat;
            }
        }
        const float a = warp_sum(sa) / C, bb = warp_sum(sb) / C;
        if constexpr (kAdd) ln_cp_async_wait_all();  // this lane's own copies: no barrier needed
        R* dxr = dx + (long long)row * C;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int c0 = (p * 32 + lane) * V;
            float d[V];
#pragma unroll
            for (int j = 0; j < V; ++j) d[j] = r * (gv[p][j] - a - xh[p][j] * bb);
            if constexpr (kAdd) {
                float dsf[V];
                ln_load<R, V>(reinterpret_cast<const R*>(&sds[((warp * P + p) * 32 + lane) * K]), dsf);
#pragma unroll
                for (int j = 0; j < V; ++j) d[j] += dsf[j];
            }
            ln_store<R, V>(dxr + c0, d);
            if constexpr (kDy) {
#pragma unroll
                for (int j = 0; j < V; ++j) d[j] = to_float(from_float<R>(d[j]));  // dx as stored
                ln_store<T, V>(dy + (long long)row * C + c0, d);
            }
        }
    }
    for (int c = threadIdx.x; c < C; c += blockDim.x) sdw[c] = sdb[c] = 0.0f;
    __syncthreads();
    for (int k = 0; k < kLnWarps; ++k) {  // warps add in a fixed order: deterministic
        if (warp == k) {
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const int c = (p * 32 + lane) * V + j;
                    sdw[c] += adw[p][j];
                    sdb[c] += adb[p][j];
                }
        }
        __syncthreads();
    }
    float* pw = partial + (long long)blockIdx.x * C;
    float* pb = partial + (long long)(gridDim.x + blockIdx.x) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        pw[c] = sdw[c];
        pb[c] = sdb[c];
    }
}

template <typename R, typename T, int C>
__global__ void __launch_bounds__(256, kLnBwdMinBlocks<T, C>) layer_norm_bwd_reg(const T* __restrict__ g, const R* __restrict__ x,
                                                          const R* __restrict__ w,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd, R* __restrict__ dx,
                                                          float* __restrict__ partial, int n) {
    ln_bwd_reg<R, T, C, false, false>(nullptr, g, x, w, mean, rstd, dx, nullptr, partial, n);
}

// The same, and dy = dx rounded to T (the `_dy` kernels: a branch's gradient when no gradient of s comes).
template <typename R, typename T, int C>
__global__ void __launch_bounds__(256, kLnBwdMinBlocks<T, C>) layer_norm_bwd_dy_reg(const T* __restrict__ g, const R* __restrict__ x,
                                                             const R* __restrict__ w,
                                                             const float* __restrict__ mean,
                                                             const float* __restrict__ rstd, R* __restrict__ dx,
                                                             T* __restrict__ dy, float* __restrict__ partial, int n) {
    ln_bwd_reg<R, T, C, false, true>(nullptr, g, x, w, mean, rstd, dx, dy, partial, n);
}

// dx = ds + layer_norm_bwd(g) for s = x + y, the saved sum (here `s`); dx is the gradient of x and y.
template <typename R, typename T, int C>
__global__ void __launch_bounds__(256, kLnBwdMinBlocks<T, C>) add_layer_norm_bwd_reg(const R* __restrict__ ds, const T* __restrict__ g,
                                                              const R* __restrict__ s, const R* __restrict__ w,
                                                              const float* __restrict__ mean,
                                                              const float* __restrict__ rstd,
                                                              R* __restrict__ dx, float* __restrict__ partial,
                                                              int n) {
    ln_bwd_reg<R, T, C, true, false>(ds, g, s, w, mean, rstd, dx, nullptr, partial, n);
}

// The same, and dy = dx rounded to T: the gradient of a branch y of type T on a residual of type R.
template <typename R, typename T, int C>
__global__ void __launch_bounds__(256, kLnBwdMinBlocks<T, C>) add_layer_norm_bwd_dy_reg(const R* __restrict__ ds, const T* __restrict__ g,
                                                                 const R* __restrict__ s, const R* __restrict__ w,
                                                                 const float* __restrict__ mean,
                                                                 const float* __restrict__ rstd,
                                                                 R* __restrict__ dx, T* __restrict__ dy,
                                                                 float* __restrict__ partial, int n) {
    ln_bwd_reg<R, T, C, true, true>(ds, g, s, w, mean, rstd, dx, dy, partial, n);
}

// dx only, any C: one warp per row, three passes over the row (kAdd: dx += ds; kDy: dy = dx rounded to T).
template <typename R, typename T, bool kAdd, bool kDy>
__device__ __forceinline__ void ln_bwd_any(const R* __restrict__ ds, const T* __restrict__ g,
                                           const R* __restrict__ x, const R* __restrict__ w,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           R* __restrict__ dx, T* __restrict__ dy, int n, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kLnWarps + (threadIdx.x >> 5);
    if (row >= n) return;
    const T* gr = g + (long long)row * C;
    const R* xr = x + (long long)row * C;
    const float mu = mean[row], r = rstd[row];
    float sa = 0.0f, sb = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float gw = to_float(gr[c]) * to_float(w[c]);
        sa += gw;
        sb += gw * (to_float(xr[c]) - mu) * r;
    }
    const float a = warp_sum(sa) / C, bb = warp_sum(sb) / C;
    R* dxr = dx + (long long)row * C;
    for (int c = lane; c < C; c += 32) {
        const float gw = to_float(gr[c]) * to_float(w[c]);
        const float xhat = (to_float(xr[c]) - mu) * r;
        float d = r * (gw - a - xhat * bb);
        if constexpr (kAdd) d += to_float(ds[(long long)row * C + c]);
        const R v = from_float<R>(d);
        dxr[c] = v;
        if constexpr (kDy) dy[(long long)row * C + c] = from_float<T>(to_float(v));
    }
}

template <typename R, typename T>
__global__ void __launch_bounds__(256) layer_norm_bwd_any(const T* __restrict__ g, const R* __restrict__ x,
                                                          const R* __restrict__ w,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd, R* __restrict__ dx,
                                                          int n, int C) {
    ln_bwd_any<R, T, false, false>(nullptr, g, x, w, mean, rstd, dx, nullptr, n, C);
}

template <typename R, typename T>
__global__ void __launch_bounds__(256) layer_norm_bwd_dy_any(const T* __restrict__ g, const R* __restrict__ x,
                                                             const R* __restrict__ w,
                                                             const float* __restrict__ mean,
                                                             const float* __restrict__ rstd, R* __restrict__ dx,
                                                             T* __restrict__ dy, int n, int C) {
    ln_bwd_any<R, T, false, true>(nullptr, g, x, w, mean, rstd, dx, dy, n, C);
}

template <typename R, typename T>
__global__ void __launch_bounds__(256) add_layer_norm_bwd_any(const R* __restrict__ ds, const T* __restrict__ g,
                                                              const R* __restrict__ s, const R* __restrict__ w,
                                                              const float* __restrict__ mean,
                                                              const float* __restrict__ rstd,
                                                              R* __restrict__ dx, int n, int C) {
    ln_bwd_any<R, T, true, false>(ds, g, s, w, mean, rstd, dx, nullptr, n, C);
}

template <typename R, typename T>
__global__ void __launch_bounds__(256) add_layer_norm_bwd_dy_any(const R* __restrict__ ds, const T* __restrict__ g,
                                                                 const R* __restrict__ s, const R* __restrict__ w,
                                                                 const float* __restrict__ mean,
                                                                 const float* __restrict__ rstd,
                                                                 R* __restrict__ dx, T* __restrict__ dy, int n, int C) {
    ln_bwd_any<R, T, true, true>(ds, g, s, w, mean, rstd, dx, dy, n, C);
}

// Partial dweight/dbias over a chunk of rows for 32 columns: block (256) = 32 columns x 8 row
// lanes, grid (ceil(C / 32), chunks). Writes partial[chunk][C] and partial[chunks + chunk][C].
template <typename R, typename T>
__global__ void __launch_bounds__(256) layer_norm_dwdb_any(const T* __restrict__ g, const R* __restrict__ x,
                                                           const float* __restrict__ mean,
                                                           const float* __restrict__ rstd,
                                                           float* __restrict__ partial, int n, int C,
                                                           int rows_per_chunk) {
    __shared__ float sw[8][33];
    __shared__ float sb[8][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + tx;
    const int r0 = blockIdx.y * rows_per_chunk;
    const int r1 = min(n, r0 + rows_per_chunk);
    float aw = 0.0f, ab = 0.0f;
    if (c < C) {
        for (int row = r0 + ty; row < r1; row += 8) {
            const float gg = to_float(g[(long long)row * C + c]);
            aw += gg * (to_float(x[(long long)row * C + c]) - mean[row]) * rstd[row];
            ab += gg;
        }
    }
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && c < C) {
        float tw = 0.0f, tb = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            tw += sw[k][tx];
            tb += sb[k][tx];
        }
        partial[(long long)blockIdx.y * C + c] = tw;
        partial[(long long)(gridDim.y + blockIdx.y) * C + c] = tb;
    }
}
