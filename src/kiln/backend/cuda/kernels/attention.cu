// Causal scaled-dot-product attention, fused, fp32 accumulation, q/k/v/out [B, H, T, D]
// contiguous, lse [B, H, T] fp32 (of the scaled scores), templated on the head dim D.
//
// Forward (flash-attention's online softmax, Dao et al. 2022): a block owns BQ query rows of
// one (b, h), each warp BQ/4 of them; key/value tiles of 32 rows go through shared memory,
// lane j scores key j, then each lane accumulates D/32 output columns. Never more than one
// [BQ, 32] tile of scores exists, so memory is O(T) and T = 16384 is fine.
// Backward recomputes the probabilities from lse: `attention_bwd_delta` forms
// delta = rowsum(dO * O); `attention_bwd_dkdv` owns a block of keys and walks the query tiles
// at or after it; `attention_bwd_dq` owns a block of queries and walks the key tiles up to
// it. Each output element is written by one thread with a fixed summation order: no atomics,
// deterministic. CUDA cores only (no tensor cores yet): correct first.
#include "common.cuh"

using namespace kiln;

constexpr int kAttnThreads = 128;  // 4 warps
constexpr int kAttnWarps = kAttnThreads / 32;

template <int D> struct AttnShape {
    // Rows per block, chosen so that every kernel's static shared memory stays under 48 KiB.
    static constexpr int fwd_q = D >= 128 ? 16 : 32;
    static constexpr int bwd_k = D >= 128 ? 8 : (D >= 64 ? 32 : 16);
    static constexpr int bwd_q = D >= 128 ? 8 : 32;
};

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) attention_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                                              const T* __restrict__ v, T* __restrict__ out,
                                                              float* __restrict__ lse, int n_t, float scale) {
    constexpr int BQ = AttnShape<D>::fwd_q;
    constexpr int RPW = BQ / kAttnWarps;
    constexpr int DL = D / 32;
    __shared__ float Qs[BQ][D];
    __shared__ float Ks[32][D + 1];
    __shared__ float Vs[32][D];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long base = (long long)blockIdx.y * n_t * D;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    for (int i = threadIdx.x; i < BQ * D; i += kAttnThreads) {
        const int r = i / D, d = i % D, row = q0 + r;
        Qs[r][d] = row < n_t ? to_float(q[base + (long long)row * D + d]) * scale : 0.0f;
    }
    float m[RPW], l[RPW], acc[RPW][DL];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        m[r] = -KILN_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < DL; ++c) acc[r][c] = 0.0f;
    }
    const int q_last = min(q0 + BQ, n_t) - 1;
    const int tiles = q_last / 32 + 1;
    for (int t = 0; t < tiles; ++t) {
        const int k0 = t * 32;
        __syncthreads();
        for (int i = threadIdx.x; i < 32 * D; i += kAttnThreads) {
            const int j = i / D, d = i % D, key = k0 + j;
            const bool ok = key < n_t;
            Ks[j][d] = ok ? to_float(k[base + (long long)key * D + d]) : 0.0f;
            Vs[j][d] = ok ? to_float(v[base + (long long)key * D + d]) : 0.0f;
        }
        __syncthreads();
        float s[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) s[r] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float kd = Ks[lane][d];
#pragma unroll
            for (int r = 0; r < RPW; ++r) s[r] += Qs[warp * RPW + r][d] * kd;
        }
        const int key = k0 + lane;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int row = q0 + warp * RPW + r;
            const float sv = (key <= row && key < n_t) ? s[r] : -KILN_INF;
            const float mn = fmaxf(m[r], warp_max(sv));
            const float pv = sv == -KILN_INF ? 0.0f : expf(sv - mn);
            const float alpha = m[r] == -KILN_INF ? 0.0f : expf(m[r] - mn);
            l[r] = l[r] * alpha + warp_sum(pv);
            m[r] = mn;
#pragma unroll
            for (int c = 0; c < DL; ++c) acc[r][c] *= alpha;
#pragma unroll 4
            for (int j = 0; j < 32; ++j) {
                const float pj = __shfl_sync(0xffffffffu, pv, j);
#pragma unroll
                for (int c = 0; c < DL; ++c) acc[r][c] += pj * Vs[j][lane + 32 * c];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = q0 + warp * RPW + r;
        if (row < n_t) {
            const float inv = 1.0f / l[r];
#pragma unroll
            for (int c = 0; c < DL; ++c)
                out[base + (long long)row * D + lane + 32 * c] = from_float<T>(acc[r][c] * inv);
            if (lane == 0) lse[(long long)blockIdx.y * n_t + row] = m[r] + logf(l[r]);
        }
    }
}

// delta[row] = sum_d grad[row, d] * out[row, d] over all B*H*T rows, one warp per row.
template <typename T, int D>
__global__ void __launch_bounds__(256) attention_bwd_delta(const T* __restrict__ grad, const T* __restrict__ out,
                                                           float* __restrict__ delta, long long rows) {
    const long long row = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
        const long long e = row * D + lane + 32 * c;
        s += to_float(grad[e]) * to_float(out[e]);
    }
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) attention_bwd_dkdv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
    int n_t, float scale) {
    constexpr int BK = AttnShape<D>::bwd_k;
    constexpr int KPW = BK / kAttnWarps;
    constexpr int DL = D / 32;
    __shared__ float Kb[BK][D];
    __shared__ float Vb[BK][D];
    __shared__ float Qs[32][D + 1];
    __shared__ float Gs[32][D + 1];
    __shared__ float Ls[32];
    __shared__ float Ds[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long base = (long long)blockIdx.y * n_t * D;
    const long long rbase = (long long)blockIdx.y * n_t;
    const int k0 = blockIdx.x * BK;  // the first keys see the most queries: they launch first
    for (int i = threadIdx.x; i < BK * D; i += kAttnThreads) {
        const int r = i / D, d = i % D, key = k0 + r;
        const bool ok = key < n_t;
        Kb[r][d] = ok ? to_float(k[base + (long long)key * D + d]) : 0.0f;
        Vb[r][d] = ok ? to_float(v[base + (long long)key * D + d]) : 0.0f;
    }
    float adk[KPW][DL], adv[KPW][DL];
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk)
#pragma unroll
        for (int c = 0; c < DL; ++c) adk[kk][c] = adv[kk][c] = 0.0f;
    const int tiles = (n_t + 31) / 32;
    for (int t = k0 / 32; t < tiles; ++t) {
        const int i0 = t * 32;
        __syncthreads();
        for (int i = threadIdx.x; i < 32 * D; i += kAttnThreads) {
            const int j = i / D, d = i % D, row = i0 + j;
            const bool ok = row < n_t;
            Qs[j][d] = ok ? to_float(q[base + (long long)row * D + d]) : 0.0f;
            Gs[j][d] = ok ? to_float(grad[base + (long long)row * D + d]) : 0.0f;
        }
        if (threadIdx.x < 32) {
            const int row = i0 + threadIdx.x;
            Ls[threadIdx.x] = row < n_t ? lse[rbase + row] : 0.0f;
            Ds[threadIdx.x] = row < n_t ? delta[rbase + row] : 0.0f;
        }
        __syncthreads();
        float s[KPW], dp[KPW];
#pragma unroll
        for (int kk = 0; kk < KPW; ++kk) s[kk] = dp[kk] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float qd = Qs[lane][d], gd = Gs[lane][d];
#pragma unroll
            for (int kk = 0; kk < KPW; ++kk) {
                s[kk] += qd * Kb[warp * KPW + kk][d];
                dp[kk] += gd * Vb[warp * KPW + kk][d];
            }
        }
        const int row = i0 + lane;
#pragma unroll
        for (int kk = 0; kk < KPW; ++kk) {
            const int key = k0 + warp * KPW + kk;
            const bool valid = row < n_t && key <= row;
            const float p = valid ? expf(s[kk] * scale - Ls[lane]) : 0.0f;
            const float ds = p * (dp[kk] - Ds[lane]);
#pragma unroll 4
            for (int j = 0; j < 32; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                for (int c = 0; c < DL; ++c) {
                    adv[kk][c] += pj * Gs[j][lane + 32 * c];
                    adk[kk][c] += dsj * Qs[j][lane + 32 * c];
                }
            }
        }
    }
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk) {
        const int key = k0 + warp * KPW + kk;
        if (key < n_t) {
#pragma unroll
            for (int c = 0; c < DL; ++c) {
                const long long e = base + (long long)key * D + lane + 32 * c;
                dk[e] = from_float<T>(adk[kk][c] * scale);
                dv[e] = from_float<T>(adv[kk][c]);
            }
        }
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) attention_bwd_dq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int n_t, float scale) {
    constexpr int BQ = AttnShape<D>::bwd_q;
    constexpr int RPW = BQ / kAttnWarps;
    constexpr int DL = D / 32;
    __shared__ float Qb[BQ][D];
    __shared__ float Gb[BQ][D];
    __shared__ float Ks[32][D + 1];
    __shared__ float Vs[32][D + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long base = (long long)blockIdx.y * n_t * D;
    const long long rbase = (long long)blockIdx.y * n_t;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    for (int i = threadIdx.x; i < BQ * D; i += kAttnThreads) {
        const int r = i / D, d = i % D, row = q0 + r;
        const bool ok = row < n_t;
        Qb[r][d] = ok ? to_float(q[base + (long long)row * D + d]) : 0.0f;
        Gb[r][d] = ok ? to_float(grad[base + (long long)row * D + d]) : 0.0f;
    }
    float lr[RPW], dr[RPW], acc[RPW][DL];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = q0 + warp * RPW + r;
        lr[r] = row < n_t ? lse[rbase + row] : 0.0f;
        dr[r] = row < n_t ? delta[rbase + row] : 0.0f;
#pragma unroll
        for (int c = 0; c < DL; ++c) acc[r][c] = 0.0f;
    }
    const int q_last = min(q0 + BQ, n_t) - 1;
    const int tiles = q_last / 32 + 1;
    for (int t = 0; t < tiles; ++t) {
        const int k0 = t * 32;
        __syncthreads();
        for (int i = threadIdx.x; i < 32 * D; i += kAttnThreads) {
            const int j = i / D, d = i % D, key = k0 + j;
            const bool ok = key < n_t;
            Ks[j][d] = ok ? to_float(k[base + (long long)key * D + d]) : 0.0f;
            Vs[j][d] = ok ? to_float(v[base + (long long)key * D + d]) : 0.0f;
        }
        __syncthreads();
        float s[RPW], dp[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) s[r] = dp[r] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float kd = Ks[lane][d], vd = Vs[lane][d];
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                s[r] += Qb[warp * RPW + r][d] * kd;
                dp[r] += Gb[warp * RPW + r][d] * vd;
            }
        }
        const int key = k0 + lane;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int row = q0 + warp * RPW + r;
            const bool valid = row < n_t && key <= row;
            const float p = valid ? expf(s[r] * scale - lr[r]) : 0.0f;
            const float ds = p * (dp[r] - dr[r]);
#pragma unroll 4
            for (int j = 0; j < 32; ++j) {
                const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                for (int c = 0; c < DL; ++c) acc[r][c] += dsj * Ks[j][lane + 32 * c];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = q0 + warp * RPW + r;
        if (row < n_t) {
#pragma unroll
            for (int c = 0; c < DL; ++c)
                dq[base + (long long)row * D + lane + 32 * c] = from_float<T>(acc[r][c] * scale);
        }
    }
}
