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
// partial sums and `column_sum_finish`.
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

}  // namespace

// The forward of one row per warp, the row held in registers (v): kAdd reads x and y and
// stores s = x + y rounded to T, normalising exactly the values stored (so the backward, which
// reads s, agrees with the forward); otherwise it normalises x. Writes out = normalised * w + b.
template <typename T, int C, bool kAdd>
__device__ __forceinline__ void ln_fwd_reg_row(const T* __restrict__ x, const T* __restrict__ y,
                                               const T* __restrict__ w, const T* __restrict__ b,
                                               T* __restrict__ s, T* __restrict__ out,
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
        const Pack<T> a = load_pack(x + off + c0);
        if constexpr (kAdd) {
            const Pack<T> e = load_pack(y + off + c0);
            Pack<T> o;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                o.v[j] = from_float<T>(to_float(a.v[j]) + to_float(e.v[j]));
                v[p][j] = to_float(o.v[j]);
                sum += v[p][j];
            }
            store_pack(s + off + c0, o);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                v[p][j] = to_float(a.v[j]);
                sum += v[p][j];
            }
        }
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
        Pack<T> o;
        const Pack<T> wp = load_pack(w + c0);
        const Pack<T> bp = load_pack(b + c0);
#pragma unroll
        for (int j = 0; j < V; ++j)
            o.v[j] = from_float<T>((v[p][j] - mu) * r * to_float(wp.v[j]) + to_float(bp.v[j]));
        store_pack(out + off + c0, o);
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// The same for any C, re-reading the row: kAdd's first pass writes s and the next two read it
// back (this thread's own stores); otherwise all three passes read x.
template <typename T, bool kAdd>
__device__ __forceinline__ void ln_fwd_any_row(const T* __restrict__ x, const T* __restrict__ y,
                                               const T* __restrict__ w, const T* __restrict__ b,
                                               T* __restrict__ s, T* __restrict__ out,
                                               float* __restrict__ mean, float* __restrict__ rstd,
                                               int n, int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kLnWarps + (threadIdx.x >> 5);
    if (row >= n) return;
    const long long off = (long long)row * C;
    const T* xr = x + off;
    T* sr = kAdd ? s + off : nullptr;
    auto at = [&](int c) -> float {
        if constexpr (kAdd) return to_float(sr[c]);
        else return to_float(xr[c]);
    };
    float sum = 0.0f;
    for (int c = lane; c < C; c += 32) {
        if constexpr (kAdd) {
            const T v = from_float<T>(to_float(xr[c]) + to_float(y[off + c]));
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

template <typename T, int C>
__global__ void __launch_bounds__(256) layer_norm_fwd_reg(const T* __restrict__ x, const T* __restrict__ w,
                                                          const T* __restrict__ b, T* __restrict__ y,
                                                          float* __restrict__ mean, float* __restrict__ rstd,
                                                          int n, float eps) {
    ln_fwd_reg_row<T, C, false>(x, nullptr, w, b, nullptr, y, mean, rstd, n, eps);
}

template <typename T>
__global__ void __launch_bounds__(256) layer_norm_fwd_any(const T* __restrict__ x, const T* __restrict__ w,
                                                          const T* __restrict__ b, T* __restrict__ y,
                                                          float* __restrict__ mean, float* __restrict__ rstd,
                                                          int n, int C, float eps) {
    ln_fwd_any_row<T, false>(x, nullptr, w, b, nullptr, y, mean, rstd, n, C, eps);
}

// s = x + y (rounded to T) and h = layer_norm(s).
template <typename T, int C>
__global__ void __launch_bounds__(256) add_layer_norm_fwd_reg(const T* __restrict__ x, const T* __restrict__ y,
                                                              const T* __restrict__ w, const T* __restrict__ b,
                                                              T* __restrict__ s, T* __restrict__ h,
                                                              float* __restrict__ mean, float* __restrict__ rstd,
                                                              int n, float eps) {
    ln_fwd_reg_row<T, C, true>(x, y, w, b, s, h, mean, rstd, n, eps);
}

template <typename T>
__global__ void __launch_bounds__(256) add_layer_norm_fwd_any(const T* __restrict__ x, const T* __restrict__ y,
                                                              const T* __restrict__ w, const T* __restrict__ b,
                                                              T* __restrict__ s, T* __restrict__ h,
                                                              float* __restrict__ mean, float* __restrict__ rstd,
                                                              int n, int C, float eps) {
    ln_fwd_any_row<T, true>(x, y, w, b, s, h, mean, rstd, n, C, eps);
}

// dx for the rows of this block's warps, and this block's partial dweight/dbias sums in
// partial[blockIdx.x][C] and partial[gridDim.x + blockIdx.x][C] (fp32).
// kAdd: dx += ds (the gradient of the LayerNorm's input that arrives by the residual stream).
// The warp's row of ds goes to shared memory by cp.async as the row starts, so its latency
// overlaps the g and x loads and the reductions without holding registers: loaded into
// registers there, ptxas keeps it live across the row and the 16-bit C = 768 kernel (GPT-2
// 124M) takes 156 registers instead of 127, one block per SM instead of two; loaded where it
// is added, its latency comes after the reductions, on every row's critical path.
template <typename T, int C, bool kAdd>
__device__ __forceinline__ void ln_bwd_reg(const T* __restrict__ ds, const T* __restrict__ g,
                                           const T* __restrict__ x, const T* __restrict__ w,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           T* __restrict__ dx, float* __restrict__ partial, int n) {
    constexpr int V = Pack<T>::N;
    constexpr int P = C / (32 * V);
    static_assert(C % (32 * V) == 0, "C must be a multiple of 32 packs");
    __shared__ float sdw[C];
    __shared__ float sdb[C];
    __shared__ int4 sds[kAdd ? kLnWarps * P * 32 : 1];  // one row of ds per warp, a pack per lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float adw[P][V], adb[P][V];
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int j = 0; j < V; ++j) adw[p][j] = adb[p][j] = 0.0f;
    for (int row = blockIdx.x * kLnWarps + warp; row < n; row += gridDim.x * kLnWarps) {
        const T* gr = g + (long long)row * C;
        const T* xr = x + (long long)row * C;
        const float mu = mean[row], r = rstd[row];
        if constexpr (kAdd) {
            const T* dsr = ds + (long long)row * C;
#pragma unroll
            for (int p = 0; p < P; ++p) ln_cp_async16(&sds[(warp * P + p) * 32 + lane], dsr + (p * 32 + lane) * V);
            ln_cp_async_commit();
        }
        float gv[P][V], xh[P][V];
        float sa = 0.0f, sb = 0.0f;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int c0 = (p * 32 + lane) * V;
            const Pack<T> gp = load_pack(gr + c0);
            const Pack<T> xp = load_pack(xr + c0);
            const Pack<T> wp = load_pack(w + c0);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float gg = to_float(gp.v[j]);
                const float xhat = (to_float(xp.v[j]) - mu) * r;
                adw[p][j] += gg * xhat;
                adb[p][j] += gg;
                const float gw = gg * to_float(wp.v[j]);
                gv[p][j] = gw;
                xh[p][j] = xhat;
                sa += gw;
                sb += gw * xhat;
            }
        }
        const float a = warp_sum(sa) / C, bb = warp_sum(sb) / C;
        if constexpr (kAdd) ln_cp_async_wait_all();  // this lane's own copies: no barrier needed
        T* dxr = dx + (long long)row * C;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int c0 = (p * 32 + lane) * V;
            Pack<T> o;
            if constexpr (kAdd) {
                Pack<T> dp;
                *reinterpret_cast<int4*>(&dp) = sds[(warp * P + p) * 32 + lane];
#pragma unroll
                for (int j = 0; j < V; ++j)
                    o.v[j] = from_float<T>(r * (gv[p][j] - a - xh[p][j] * bb) + to_float(dp.v[j]));
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(r * (gv[p][j] - a - xh[p][j] * bb));
            }
            store_pack(dxr + c0, o);
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

template <typename T, int C>
__global__ void __launch_bounds__(256) layer_norm_bwd_reg(const T* __restrict__ g, const T* __restrict__ x,
                                                          const T* __restrict__ w,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd, T* __restrict__ dx,
                                                          float* __restrict__ partial, int n) {
    ln_bwd_reg<T, C, false>(nullptr, g, x, w, mean, rstd, dx, partial, n);
}

// dx = ds + layer_norm_bwd(g) for s = x + y, the saved sum (here `s`); dx is the gradient of x and y.
template <typename T, int C>
__global__ void __launch_bounds__(256) add_layer_norm_bwd_reg(const T* __restrict__ ds, const T* __restrict__ g,
                                                              const T* __restrict__ s, const T* __restrict__ w,
                                                              const float* __restrict__ mean,
                                                              const float* __restrict__ rstd,
                                                              T* __restrict__ dx, float* __restrict__ partial,
                                                              int n) {
    ln_bwd_reg<T, C, true>(ds, g, s, w, mean, rstd, dx, partial, n);
}

// dx only, any C: one warp per row, three passes over the row (kAdd: dx += ds).
template <typename T, bool kAdd>
__device__ __forceinline__ void ln_bwd_any(const T* __restrict__ ds, const T* __restrict__ g,
                                           const T* __restrict__ x, const T* __restrict__ w,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           T* __restrict__ dx, int n, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kLnWarps + (threadIdx.x >> 5);
    if (row >= n) return;
    const T* gr = g + (long long)row * C;
    const T* xr = x + (long long)row * C;
    const float mu = mean[row], r = rstd[row];
    float sa = 0.0f, sb = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float gw = to_float(gr[c]) * to_float(w[c]);
        sa += gw;
        sb += gw * (to_float(xr[c]) - mu) * r;
    }
    const float a = warp_sum(sa) / C, bb = warp_sum(sb) / C;
    T* dxr = dx + (long long)row * C;
    for (int c = lane; c < C; c += 32) {
        const float gw = to_float(gr[c]) * to_float(w[c]);
        const float xhat = (to_float(xr[c]) - mu) * r;
        float d = r * (gw - a - xhat * bb);
        if constexpr (kAdd) d += to_float(ds[(long long)row * C + c]);
        dxr[c] = from_float<T>(d);
    }
}

template <typename T>
__global__ void __launch_bounds__(256) layer_norm_bwd_any(const T* __restrict__ g, const T* __restrict__ x,
                                                          const T* __restrict__ w,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd, T* __restrict__ dx,
                                                          int n, int C) {
    ln_bwd_any<T, false>(nullptr, g, x, w, mean, rstd, dx, n, C);
}

template <typename T>
__global__ void __launch_bounds__(256) add_layer_norm_bwd_any(const T* __restrict__ ds, const T* __restrict__ g,
                                                              const T* __restrict__ s, const T* __restrict__ w,
                                                              const float* __restrict__ mean,
                                                              const float* __restrict__ rstd,
                                                              T* __restrict__ dx, int n, int C) {
    ln_bwd_any<T, true>(ds, g, s, w, mean, rstd, dx, n, C);
}

// Partial dweight/dbias over a chunk of rows for 32 columns: block (256) = 32 columns x 8 row
// lanes, grid (ceil(C / 32), chunks). Writes partial[chunk][C] and partial[chunks + chunk][C].
template <typename T>
__global__ void __launch_bounds__(256) layer_norm_dwdb_any(const T* __restrict__ g, const T* __restrict__ x,
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
