// Scaled-dot-product attention, fused, fp32 accumulation, templated on the head dim D: causal
// self-attention, and the blocks of context parallelism (a query chunk of n_q rows against a
// key/value chunk of n_k rows, causal with an offset or full: the mask `off` below).
// q/out/grad/dq are [B, H, n_q, D] and k/v/dk/dv [B, H, n_k, D], with unit stride along D and any
// batch, head and row strides, passed per operand group (Layout: q; k and v; out and grad; dq;
// dk and dv): q, k, v and the packed gradients can be views of one [B, T, 3, H, D] buffer and
// out/grad views of [B, T, H, D], with no permute copies. lse and delta are [B, H, n_q] fp32
// contiguous (lse of the scaled scores).
// Mask: query row i sees key j iff j <= i + off (and j < n_k): off = 0 is causal self-attention,
// off > 0 a query chunk that starts off positions after its key chunk, off = n_k full attention.
// off >= 0 (the launcher checks), so every row sees key 0 and no softmax is empty.
//
// Forward (flash-attention's online softmax, Dao et al. 2022): a block owns a block of query
// rows of one (b, h) and walks the key/value tiles up to the last key its last row sees; never
// more than one tile of scores exists, so memory is O(T) and T = 16384 is fine.
// Backward recomputes the probabilities from lse: `attention_bwd_delta` forms
// delta = rowsum(dO * O); `attention_bwd_dkdv` owns a block of keys and walks the query tiles
// that see it; `attention_bwd_dq` owns a block of queries and walks the key tiles it sees.
// Each output element is written by one thread with a fixed summation order: no atomics,
// deterministic. (`attention_bwd_fused_tc`, near the end, does both walks' work in the first one
// and adds dQ's contributions in whatever order the blocks run: not deterministic, so never the
// default.) float32 runs on the CUDA cores (register-tiled, strict IEEE fp32 FMAs: no TF32), or
// under tf32 products (kiln's tf32 mode) on the TF32 tensor cores (`*_tf32`, mma.sync, the last
// section); bfloat16 and float16 take the tensor-core kernels (`*_tc`, Hopper wgmma, and the TMA
// kernels after them), which keep the same structure.
#include "common.cuh"

using namespace kiln;

constexpr int kAttnThreads = KILN_ATTN_TC_THREADS;  // 4 warps (tensor-core kernels)

// Element (b, h, t, d) of an operand lies at b * sb + h * sh + t * st + d.
#define KILN_LAYOUT(p) long long p##_sb, long long p##_sh, long long p##_st
__device__ __forceinline__ long long head_offset(int bh, int n_h, long long sb, long long sh) {
    return (long long)(bh / n_h) * sb + (long long)(bh % n_h) * sh;
}

// The order blocks take work in: job w of n_bh heads x n_blocks row blocks, numbered by groups of `group`
// heads (the last group may be smaller), inside a group by rank (rank 0: the row block with the most
// tiles to walk, which the kernel maps to its rows), heads inside a rank. The blocks of a group read the
// same heads' operands close in time (L2), and the longest work of every group starts first, so the
// blocks finish together: the launcher's head_group sizes the groups. Every (head, row block) once.
struct GroupedJob {
    int bh, rank;
    __device__ __forceinline__ GroupedJob(int w, int n_bh, int n_blocks, int group) {
        const int g0 = w / (group * n_blocks) * group, size = min(group, n_bh - g0), r = w - g0 * n_blocks;
        bh = g0 + r % size;
        rank = r / size;
    }
};

// This block's job in a grid of gridDim.x row blocks by gridDim.y heads: the GPU starts blocks in the
// order of their linear index (x fastest), so that index is the job number.
// The indices are read with asm volatile, so that every call reads them afresh: a kernel asks again after
// its main loop rather than keep the job in registers across it (ptxas rematerialises blockIdx itself,
// not arithmetic on it: dQ at D = 64 spilled 12 bytes with the job kept).
__device__ __forceinline__ GroupedJob grid_job(int group) {
    unsigned int x, y, nx, ny;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(y));
    asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(nx));
    asm volatile("mov.u32 %0, %%nctaid.y;\n" : "=r"(ny));
    return GroupedJob((int)(x + y * nx), (int)ny, (int)nx, group);
}

// ---- Asynchronous global -> shared copies (cp.async), used by every kernel of this file ------

using u32 = unsigned int;  // NVRTC has no <cstdint>

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Global -> shared without a trip through registers; zero-filled when !ok (src stays a valid
// address then, the caller clamps it).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- float32 on the CUDA cores: register-tiled ------------------------------------------
//
// 64 threads (2 warps) per block. Every product is an outer product in registers: a thread owns
// TM rows of the left operand and TN (or TE) rows/columns of the right one and, per step of the
// reduction, loads both from shared memory as float4s, so at D <= 64 each loaded word feeds 2.7 (S,
// 8 x 4) to 4 (P·V, dV, dK, dQ, 8 x 8) FMAs; the old kernels fed about 1. Lanes: mg = lane bits 1 and 4
// picks the thread's TM consecutive rows (4 groups of a warp), ng = bits 0, 2, 3 its columns (8
// groups), so lanes n and n^1 load the same left words and n and n^2 the same right words.
//   S = A·Bᵀ (reduction over D): A stored transposed ([d][row], a thread's rows contiguous), B
//     row-major [row][D + 4] (a thread's TN rows ng, ng + 8, ...; the pad of 4 puts the 8 row
//     groups on distinct banks); per 4 d: TM + TN float4 loads, 4 TM TN FMAs.
//   C += P·V (reduction over the tile's rows): P stored transposed [key][row] (the score step
//     writes it so), V row-major (a thread's columns 4 ng + 32 c + 0..3); per row: TM/4 + TE/4
//     float4 loads, TM TE FMAs.
// Every shared-memory load of these loops is free of bank conflicts. Exponentials are exp2f of
// scores in log2 units (scale·log2 e folded into Q or into one multiplier).
// Forward: one block = 2 x 4 TM query rows, each warp 4 TM rows against every key of a tile of
// BN keys; the row max is reduced over the 8 ng lanes by shuffles, each lane keeps its part of
// the row sum; P goes to the P·V step through shared memory ([key][row], each warp its rows). K
// and V tiles arrive by cp.async without a second buffer: K(t+1) lands while P·V(t) runs and
// V(t+1) while S(t+1) does. dK/dV: one block = 4 TM keys; per query tile, warp 0 computes
// Sᵀ = K·Qᵀ -> Pᵀ and warp 1 dPᵀ = V·dOᵀ -> dSᵀ = Pᵀ∘(dPᵀ - delta); then warp 0 accumulates
// dV += Pᵀ·dO and warp 1 dK += dSᵀ·Q (TM x TE each). dQ: one block = 4 TM queries; per key tile,
// warp 0 computes S -> P and warp 1 dP -> dS, then each warp accumulates dQ += dS·K over its
// half of the tile's keys; the halves are added in a fixed order at the end. Static shared
// memory: 35-45 KiB a block.

constexpr int kF32Threads = KILN_ATTN_F32_THREADS;
// Resident blocks per SM asked of ptxas (so <= 204 registers): static shared memory (35-45 KiB a
// block) allows 5 anyway. With it every kernel fits in 168 registers; without it dQ at D = 32
// spilled.
constexpr int kF32MinBlocks = 5;
constexpr float kF32Log2e = 1.4426950408889634f;
constexpr float kF32Ln2 = 0.6931471805599453f;

template <int D> struct F32Shape {
    static constexpr int TM = D >= 128 ? 4 : 8;  // rows (keys in dK/dV) of a thread
    static constexpr int WM = 4 * TM;            // rows of a warp (4 mg groups)
    static constexpr int BN = D <= 32 ? 64 : (D <= 64 ? 32 : 16);  // rows of a streamed tile
    static constexpr int TN = BN / 8;            // streamed rows of a thread in a score tile
    static constexpr int TE = D / 8;             // output columns of a thread
    static_assert(TM % 4 == 0 && TE % 4 == 0 && BN % 8 == 0, "float4 micro-tiles");
};

__device__ __forceinline__ int f32_mg(int lane) { return ((lane >> 1) & 1) | ((lane >> 3) & 2); }
__device__ __forceinline__ int f32_ng(int lane) { return (lane & 1) | ((lane >> 1) & 6); }

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void sts4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float f4_at(const float4& v, int i) {  // i is a constant after unrolling
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Max and sum over the 8 lanes of one mg group (lane bits 0, 2, 3). Every lane gets the same bits.
__device__ __forceinline__ float ng_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
}
__device__ __forceinline__ float ng_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    return v + __shfl_xor_sync(0xffffffffu, v, 8);
}

// Starts copying rows [r0, r0 + R) of a [n_t, D] fp32 matrix with row stride ld (16-byte aligned
// rows) into dst[R][LD] (zeros past n_t), the block's THREADS threads sharing the work; the caller
// commits the group.
template <int R, int D, int LD, int THREADS = kF32Threads>
__device__ __forceinline__ void f32_rows_async(float* dst, const float* __restrict__ src, int ld, int r0, int n_t) {
    constexpr int CH = D / 4;                // 16-byte chunks per row
    constexpr int RP = THREADS / CH;         // rows per pass of the block
    static_assert(THREADS % CH == 0 && R % RP == 0, "tile chunks must divide among the threads");
    const int r = threadIdx.x / CH, c = (threadIdx.x % CH) * 4;
    const float* p = src + ((r0 + r) * ld + c);
    const u32 d = smem_addr(dst + r * LD + c);
#pragma unroll
    for (int it = 0; it < R / RP; ++it) {
        const bool ok = r0 + r + it * RP < n_t;
        cp_async16(d + it * RP * LD * 4, ok ? p + it * RP * ld : src, ok);
    }
}

// The same for R floats [r0, r0 + R) of a vector.
template <int R, int THREADS = kF32Threads>
__device__ __forceinline__ void f32_vec_async(float* dst, const float* __restrict__ src, int r0, int n_t) {
    for (int i = threadIdx.x; i < R; i += THREADS) {
        const bool ok = r0 + i < n_t;
        cp_async4(smem_addr(dst + i), src + (ok ? r0 + i : 0), ok);
    }
}

// Rows [r0, r0 + R) of a [n_t, D] fp32 matrix (row stride ld) times mul, transposed into
// dst[D][R] (zeros past n_t). Consecutive threads take consecutive rows: conflict-free stores.
template <int R, int D>
__device__ __forceinline__ void f32_load_t(float* dst, const float* __restrict__ src, int ld, int r0, int n_t,
                                           float mul) {
    for (int i = threadIdx.x; i < R * D / 4; i += kF32Threads) {
        const int r = i % R, c = (i / R) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r0 + r < n_t) x = *reinterpret_cast<const float4*>(src + ((r0 + r) * ld + c));
        dst[(c + 0) * R + r] = x.x * mul;
        dst[(c + 1) * R + r] = x.y * mul;
        dst[(c + 2) * R + r] = x.z * mul;
        dst[(c + 3) * R + r] = x.w * mul;
    }
}

// acc[i][j] += sum_{d < K} At[d * LDA + i] * B[8 j * LDB + d]: At is the left operand stored
// transposed (offset to this thread's first row), B the right one row-major (offset to this
// thread's first row, the others 8 rows apart).
template <int TM, int TN, int K, int LDA, int LDB>
__device__ __forceinline__ void f32_mma_abt(float (&acc)[TM][TN], const float* At, const float* B) {
    static_assert(K % 4 == 0, "K in steps of 4");
#pragma unroll 2
    for (int d = 0; d < K; d += 4) {
        float4 b[TN];
#pragma unroll
        for (int j = 0; j < TN; ++j) b[j] = lds4(B + 8 * j * LDB + d);
#pragma unroll
        for (int dd = 0; dd < 4; ++dd) {
            float a[TM];
#pragma unroll
            for (int i = 0; i < TM; i += 4) {
                const float4 x = lds4(At + (d + dd) * LDA + i);
                a[i] = x.x;
                a[i + 1] = x.y;
                a[i + 2] = x.z;
                a[i + 3] = x.w;
            }
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const float bj = f4_at(b[j], dd);
#pragma unroll
                for (int i = 0; i < TM; ++i) acc[i][j] = fmaf(a[i], bj, acc[i][j]);
            }
        }
    }
}

// acc[i][e] += sum_{k < K} At[k * LDA + i] * B[k * LDB + 32 (e / 4) + e % 4]: At is the left
// operand stored transposed (offset to this thread's first row), B the right one row-major
// (offset to this thread's first column, 4 ng).
template <int TM, int TE, int K, int LDA, int LDB>
__device__ __forceinline__ void f32_mma_ab(float (&acc)[TM][TE], const float* At, const float* B) {
#pragma unroll 8
    for (int k = 0; k < K; ++k) {
        float a[TM], b[TE];
#pragma unroll
        for (int i = 0; i < TM; i += 4) {
            const float4 x = lds4(At + k * LDA + i);
            a[i] = x.x;
            a[i + 1] = x.y;
            a[i + 2] = x.z;
            a[i + 3] = x.w;
        }
#pragma unroll
        for (int e = 0; e < TE; e += 4) {
            const float4 x = lds4(B + k * LDB + 8 * e);
            b[e] = x.x;
            b[e + 1] = x.y;
            b[e + 2] = x.z;
            b[e + 3] = x.w;
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int e = 0; e < TE; ++e) acc[i][e] = fmaf(a[i], b[e], acc[i][e]);
    }
}

template <int M, int N> __device__ __forceinline__ void f32_zero(float (&a)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) a[i][j] = 0.0f;
}

// Row i of this thread's TE output columns (4 ng + 32 c + 0..3) times mul, as float4 stores.
template <int TE>
__device__ __forceinline__ void f32_store_row(float* __restrict__ dst, const float (&x)[TE], float mul) {
#pragma unroll
    for (int e = 0; e < TE; e += 4)
        *reinterpret_cast<float4*>(dst + 8 * e) =
            make_float4(x[e] * mul, x[e + 1] * mul, x[e + 2] * mul, x[e + 3] * mul);
}

template <typename T, int D>
__global__ void __launch_bounds__(kF32Threads, kF32MinBlocks)
    attention_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                  float* __restrict__ lse, int n_q, int n_k, int off, int n_h, float scale, KILN_LAYOUT(q),
                  KILN_LAYOUT(kv), KILN_LAYOUT(o)) {
    using S = F32Shape<D>;
    constexpr int TM = S::TM, TN = S::TN, TE = S::TE, BN = S::BN, BQ = 2 * S::WM;
    constexpr int LDK = D + 4, LDP = BQ + 4;
    __shared__ __align__(16) float Qt[D * BQ];   // this block's queries times scale log2 e, [d][row]
    __shared__ __align__(16) float Ks[BN * LDK];  // key tile, [key][d]
    __shared__ __align__(16) float Vs[BN * D];    // value tile, [key][d]
    __shared__ __align__(16) float Pt[BN * LDP];  // probabilities, [key][row] (each warp its rows)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mg = f32_mg(lane), ng = f32_ng(lane);
    const long long base = head_offset(blockIdx.y, n_h, kv_sb, kv_sh);
    const float* kb = k + base;
    const float* vb = v + base;
    const int ld = (int)kv_st;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    const int rl = warp * S::WM + mg * TM;              // this thread's first row in the block
    const int row0 = q0 + rl;
    const int warp_row0 = q0 + warp * S::WM;
    const int k_end = min(n_k, min(q0 + BQ, n_q) - 1 + off + 1);  // keys some row of the block sees
    const int n_tiles = (k_end - 1) / BN + 1;
    f32_rows_async<BN, D, LDK>(Ks, kb, ld, 0, n_k);
    cp_async_commit();
    f32_rows_async<BN, D, D>(Vs, vb, ld, 0, n_k);
    cp_async_commit();
    f32_load_t<BQ, D>(Qt, q + head_offset(blockIdx.y, n_h, q_sb, q_sh), (int)q_st, q0, n_q,
                      scale * kF32Log2e);  // scores in log2 units
    float m[TM], l[TM], o[TM][TE];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        m[i] = -KILN_INF;
        l[i] = 0.0f;
    }
    f32_zero(o);
    for (int t = 0; t < n_tiles; ++t) {
        const int k0 = t * BN;
        cp_async_wait_group<1>();  // K(t) has landed (V(t) may still be in flight)
        __syncthreads();           // ... for everyone (and Qt, at t = 0)
        // A warp whose rows all precede this tile's keys skips it. Every warp takes tile 0, whose
        // key 0 is valid for every row, so m is finite from then on (no -inf - -inf).
        const bool active = k0 <= warp_row0 + S::WM - 1 + off;
        if (active) {
            float s[TM][TN];
            f32_zero(s);
            f32_mma_abt<TM, TN, D, BQ, LDK>(s, Qt + rl, Ks + ng * LDK);
            // some key of the tile is hidden from some row of the warp
            const bool diag = k0 + BN - 1 > warp_row0 + off || k0 + BN > n_k;
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                float mx = -KILN_INF;
#pragma unroll
                for (int j = 0; j < TN; ++j) {
                    const int key = k0 + ng + 8 * j;
                    if (diag && (key > row0 + i + off || key >= n_k)) s[i][j] = -KILN_INF;
                    mx = fmaxf(mx, s[i][j]);
                }
                const float mn = fmaxf(m[i], ng_max(mx));
                const float alpha = exp2f(m[i] - mn);
                m[i] = mn;
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < TN; ++j) {
                    s[i][j] = exp2f(s[i][j] - mn);
                    sum += s[i][j];
                }
                l[i] = l[i] * alpha + sum;  // this lane's part of the row sum; the 8 lanes are summed at the end
#pragma unroll
                for (int e = 0; e < TE; ++e) o[i][e] *= alpha;
            }
#pragma unroll
            for (int j = 0; j < TN; ++j)
#pragma unroll
                for (int i = 0; i < TM; i += 4)
                    sts4(Pt + (ng + 8 * j) * LDP + rl + i, make_float4(s[i][j], s[i + 1][j], s[i + 2][j], s[i + 3][j]));
        }
        cp_async_wait_group<0>();  // V(t) has landed
        __syncthreads();           // ... for everyone; everyone is done with Ks; Pt is written
        if (t + 1 < n_tiles) {
            f32_rows_async<BN, D, LDK>(Ks, kb, ld, k0 + BN, n_k);
            cp_async_commit();
        }
        if (active) f32_mma_ab<TM, TE, BN, LDP, D>(o, Pt + rl, Vs + ng * 4);
        __syncthreads();  // everyone is done with Vs (and its Pt)
        if (t + 1 < n_tiles) {
            f32_rows_async<BN, D, D>(Vs, vb, ld, k0 + BN, n_k);
            cp_async_commit();
        }
    }
    T* ob = out + head_offset(blockIdx.y, n_h, o_sb, o_sh);
    const int ldo = (int)o_st;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const float lt = ng_sum(l[i]);
        const int row = row0 + i;
        if (row < n_q) {
            f32_store_row<TE>(ob + (row * ldo + ng * 4), o[i], 1.0f / lt);
            if (ng == 0) lse[(long long)blockIdx.y * n_q + row] = (m[i] + log2f(lt)) * kF32Ln2;
        }
    }
}

// delta[row] = sum_d grad[row, d] * out[row, d] over all B*H*T rows: L = D / V lanes per row, each
// reading V = 16 / sizeof(T) elements of both operands as one 16-byte load (every row is 16-byte
// aligned: the launcher's _strides), 256 / L rows per block (delta_rows_per_block), the L partial
// sums added by shuffles. (One warp per row moved 64 bytes per load instruction at D = 64 bf16.)
// grad and out each have their own layout (out is [B, T, H, D] from the forward, grad whatever
// the layer above gave): no copy of either into the other's.
template <typename T, int D>
__global__ void __launch_bounds__(256) attention_bwd_delta(const T* __restrict__ grad, const T* __restrict__ out,
                                                           float* __restrict__ delta, long long rows, int n_t,
                                                           int n_h, KILN_LAYOUT(g), KILN_LAYOUT(o)) {
    constexpr int V = 16 / (int)sizeof(T), L = D / V;
    static_assert(D % V == 0 && L <= 32 && 32 % L == 0, "a row's lanes are a power of two within a warp");
    const long long row = (long long)blockIdx.x * (256 / L) + threadIdx.x / L;
    const int part = threadIdx.x % L;
    float s = 0.0f;
    if (row < rows) {
        const int bh = (int)(row / n_t);
        const long long t = row % n_t;
        const T* g = grad + head_offset(bh, n_h, g_sb, g_sh) + t * g_st + part * V;
        const T* o = out + head_offset(bh, n_h, o_sb, o_sh) + t * o_st + part * V;
        const uint4 gv = __ldg(reinterpret_cast<const uint4*>(g));
        const uint4 ov = __ldg(reinterpret_cast<const uint4*>(o));
        const T* gs = reinterpret_cast<const T*>(&gv);
        const T* os = reinterpret_cast<const T*>(&ov);
#pragma unroll
        for (int i = 0; i < V; ++i) s += to_float(gs[i]) * to_float(os[i]);
    }
#pragma unroll
    for (int o_ = L / 2; o_ > 0; o_ >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o_);
    if (row < rows && part == 0) delta[row] = s;
}

template <typename T, int D>
__global__ void __launch_bounds__(kF32Threads, kF32MinBlocks) attention_bwd_dkdv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
    int n_q, int n_k, int off, int n_h, float scale, KILN_LAYOUT(q), KILN_LAYOUT(kv), KILN_LAYOUT(o),
    KILN_LAYOUT(dkv)) {
    using S = F32Shape<D>;
    constexpr int TM = S::TM, TN = S::TN, TE = S::TE, BN = S::BN, BK = S::WM;
    constexpr int LDQ = D + 4, LDP = BK + 4;
    __shared__ __align__(16) float Kt[D * BK];    // this block's keys, [d][key]
    __shared__ __align__(16) float Vt[D * BK];    // and values, [d][key]
    __shared__ __align__(16) float Qs[BN * LDQ];  // query tile, [query][d]
    __shared__ __align__(16) float Gs[BN * LDQ];  // its output gradients, [query][d]
    __shared__ __align__(16) float Ps[BN * LDP];  // Pᵀ, [query][key]
    __shared__ __align__(16) float Ss[BN * LDP];  // dSᵀ, [query][key]
    __shared__ __align__(16) float Ls[BN];
    __shared__ __align__(16) float Ds[BN];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mg = f32_mg(lane), ng = f32_ng(lane);
    const long long base = head_offset(blockIdx.y, n_h, kv_sb, kv_sh), rbase = (long long)blockIdx.y * n_q;
    const float* qb = q + head_offset(blockIdx.y, n_h, q_sb, q_sh);
    const float* gb = grad + head_offset(blockIdx.y, n_h, o_sb, o_sh);
    const int ld = (int)q_st, ldo = (int)o_st;
    const int k0 = blockIdx.x * BK;  // the first keys see the most queries: they launch first
    const int kl = mg * TM;          // this thread's first key in the block
    const int q_begin = (max(k0 - off, 0) / BN) * BN;  // the first query tile that sees key k0
    const int n_tiles = q_begin < n_q ? (n_q - q_begin + BN - 1) / BN : 0;
    const float sl2 = scale * kF32Log2e;  // exponentials in log2 units
    if (n_tiles > 0) {
        f32_rows_async<BN, D, LDQ>(Qs, qb, ld, q_begin, n_q);
        f32_rows_async<BN, D, LDQ>(Gs, gb, ldo, q_begin, n_q);
        f32_vec_async<BN>(Ls, lse + rbase, q_begin, n_q);
        f32_vec_async<BN>(Ds, delta + rbase, q_begin, n_q);
        cp_async_commit();
    }
    f32_load_t<BK, D>(Kt, k + base, (int)kv_st, k0, n_k, 1.0f);
    f32_load_t<BK, D>(Vt, v + base, (int)kv_st, k0, n_k, 1.0f);
    // Warp 0: Sᵀ = K·Qᵀ -> Pᵀ, then dV += Pᵀ·dO. Warp 1: dPᵀ = V·dOᵀ -> dSᵀ, then dK += dSᵀ·Q.
    const float* a1 = (warp ? Vt : Kt) + kl;
    const float* b1 = (warp ? Gs : Qs) + ng * LDQ;
    const float* a2 = (warp ? Ss : Ps) + kl;
    const float* b2 = (warp ? Qs : Gs) + ng * 4;
    float acc[TM][TE];
    f32_zero(acc);
    for (int it = 0; it < n_tiles; ++it) {
        const int i0 = q_begin + it * BN;
        cp_async_wait_all();
        __syncthreads();  // the query tile has landed for everyone (and Kt, Vt at it = 0)
        float s[TM][TN];
        f32_zero(s);
        f32_mma_abt<TM, TN, D, BK, LDQ>(s, a1, b1);
        if (warp == 0) {
            // Masks only where some query misses some key of the block, or past n_q.
            const bool edge = i0 + off < k0 + BK - 1 || i0 + BN > n_q;
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int qi = ng + 8 * j, query = i0 + qi;
                const float lq = Ls[qi] * kF32Log2e;
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const float p = exp2f(s[i][j] * sl2 - lq);
                    s[i][j] = (!edge || (k0 + kl + i <= query + off && query < n_q)) ? p : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < TM; i += 4)
                    sts4(Ps + qi * LDP + kl + i, make_float4(s[i][j], s[i + 1][j], s[i + 2][j], s[i + 3][j]));
            }
        }
        __syncthreads();  // Pᵀ is written
        if (warp == 1) {
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int qi = ng + 8 * j;
                const float dq = Ds[qi];
#pragma unroll
                for (int i = 0; i < TM; i += 4) {
                    const float4 p = lds4(Ps + qi * LDP + kl + i);
                    sts4(Ss + qi * LDP + kl + i, make_float4(p.x * (s[i][j] - dq), p.y * (s[i + 1][j] - dq),
                                                             p.z * (s[i + 2][j] - dq), p.w * (s[i + 3][j] - dq)));
                }
            }
            __syncwarp();  // dSᵀ is written (only this warp reads it)
        }
        f32_mma_ab<TM, TE, BN, LDP, LDQ>(acc, a2, b2);
        __syncthreads();  // everyone is done with this query tile
        if (it + 1 < n_tiles) {
            const int i1 = i0 + BN;
            f32_rows_async<BN, D, LDQ>(Qs, qb, ld, i1, n_q);
            f32_rows_async<BN, D, LDQ>(Gs, gb, ldo, i1, n_q);
            f32_vec_async<BN>(Ls, lse + rbase, i1, n_q);
            f32_vec_async<BN>(Ds, delta + rbase, i1, n_q);
            cp_async_commit();
        }
    }
    T* dst = (warp ? dk : dv) + head_offset(blockIdx.y, n_h, dkv_sb, dkv_sh);
    const float mul = warp ? scale : 1.0f;
    const int ldg = (int)dkv_st;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int key = k0 + kl + i;
        if (key < n_k) f32_store_row<TE>(dst + (key * ldg + ng * 4), acc[i], mul);
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kF32Threads, kF32MinBlocks) attention_bwd_dq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int n_q, int n_k, int off,
    int n_h, float scale, KILN_LAYOUT(q), KILN_LAYOUT(kv), KILN_LAYOUT(o), KILN_LAYOUT(dq)) {
    using S = F32Shape<D>;
    constexpr int TM = S::TM, TN = S::TN, TE = S::TE, BN = S::BN, BQ = S::WM, HN = BN / 2;
    constexpr int LDK = D + 4, LDP = BQ + 4;
    __shared__ __align__(16) float Qt[D * BQ];    // this block's queries, [d][row]
    __shared__ __align__(16) float Gt[D * BQ];    // and output gradients, [d][row]
    __shared__ __align__(16) float Ks[BN * LDK];  // key tile, [key][d]
    __shared__ __align__(16) float Vs[BN * LDK];  // value tile, [key][d]
    __shared__ __align__(16) float Ps[BN * LDP];  // P, [key][row]
    __shared__ __align__(16) float Ss[BN * LDP];  // dS, [key][row]
    static_assert(BQ * D <= BN * LDK, "the partial dQ of warp 1 goes through Ks");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mg = f32_mg(lane), ng = f32_ng(lane);
    const long long base = head_offset(blockIdx.y, n_h, kv_sb, kv_sh), rbase = (long long)blockIdx.y * n_q;
    const float* kb = k + base;
    const float* vb = v + base;
    const int ld = (int)kv_st;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    const int rl = mg * TM;                             // this thread's first row in the block
    const int row0 = q0 + rl;
    const int k_end = min(n_k, min(q0 + BQ, n_q) - 1 + off + 1);  // keys some row of the block sees
    const int n_tiles = (k_end - 1) / BN + 1;
    f32_rows_async<BN, D, LDK>(Ks, kb, ld, 0, n_k);
    f32_rows_async<BN, D, LDK>(Vs, vb, ld, 0, n_k);
    cp_async_commit();
    f32_load_t<BQ, D>(Qt, q + head_offset(blockIdx.y, n_h, q_sb, q_sh), (int)q_st, q0, n_q, 1.0f);
    f32_load_t<BQ, D>(Gt, grad + head_offset(blockIdx.y, n_h, o_sb, o_sh), (int)o_st, q0, n_q, 1.0f);
    // Warp 0: S = Q·Kᵀ -> P (needs lse). Warp 1: dP = dO·Vᵀ -> dS = P∘(dP - delta) (needs delta).
    const float* rvec = warp ? delta : lse;
    float rv[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) rv[i] = row0 + i < n_q ? rvec[rbase + row0 + i] : 0.0f;
    const float sl2 = scale * kF32Log2e;  // exponentials in log2 units: warp 0 takes lse log2 e
    float lr[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) lr[i] = rv[i] * kF32Log2e;
    const float* a1 = (warp ? Gt : Qt) + rl;
    const float* b1 = (warp ? Vs : Ks) + ng * LDK;
    float acc[TM][TE];
    f32_zero(acc);
    for (int t = 0; t < n_tiles; ++t) {
        const int k0 = t * BN;
        cp_async_wait_all();
        __syncthreads();  // the key/value tile has landed for everyone (and Qt, Gt at t = 0)
        float s[TM][TN];
        f32_zero(s);
        f32_mma_abt<TM, TN, D, BQ, LDK>(s, a1, b1);
        if (warp == 0) {
            const bool diag = k0 + BN - 1 > q0 + off || k0 + BN > n_k;  // some key hidden from some row
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int key = k0 + ng + 8 * j;
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const float p = exp2f(s[i][j] * sl2 - lr[i]);
                    s[i][j] = (!diag || (key <= row0 + i + off && key < n_k)) ? p : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < TM; i += 4)
                    sts4(Ps + (ng + 8 * j) * LDP + rl + i, make_float4(s[i][j], s[i + 1][j], s[i + 2][j], s[i + 3][j]));
            }
        }
        __syncthreads();  // P is written; everyone is done with Vs
        if (t + 1 < n_tiles) {
            f32_rows_async<BN, D, LDK>(Vs, vb, ld, k0 + BN, n_k);
            cp_async_commit();
        }
        if (warp == 1) {
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int kj = ng + 8 * j;
#pragma unroll
                for (int i = 0; i < TM; i += 4) {
                    const float4 p = lds4(Ps + kj * LDP + rl + i);
                    sts4(Ss + kj * LDP + rl + i,
                         make_float4(p.x * (s[i][j] - rv[i]), p.y * (s[i + 1][j] - rv[i + 1]),
                                     p.z * (s[i + 2][j] - rv[i + 2]), p.w * (s[i + 3][j] - rv[i + 3])));
                }
            }
        }
        __syncthreads();  // dS is written
        // Warp w sums the keys [w HN, (w + 1) HN) of the tile.
        f32_mma_ab<TM, TE, HN, LDP, LDK>(acc, Ss + warp * HN * LDP + rl, Ks + warp * HN * LDK + ng * 4);
        __syncthreads();  // everyone is done with Ks and dS
        if (t + 1 < n_tiles) {
            f32_rows_async<BN, D, LDK>(Ks, kb, ld, k0 + BN, n_k);
            cp_async_commit();
        }
    }
    // dQ = (warp 0's part + warp 1's part) * scale, in that order; warp 1's goes through Ks.
    float* part = Ks + rl * D + ng * 4;
    if (warp == 1) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int e = 0; e < TE; e += 4)
                sts4(part + i * D + 8 * e, make_float4(acc[i][e], acc[i][e + 1], acc[i][e + 2], acc[i][e + 3]));
    }
    __syncthreads();
    if (warp == 0) {
        T* db = dq + head_offset(blockIdx.y, n_h, dq_sb, dq_sh);
        const int ldg = (int)dq_st;
#pragma unroll
        for (int i = 0; i < TM; ++i) {
#pragma unroll
            for (int e = 0; e < TE; e += 4) {
                const float4 x = lds4(part + i * D + 8 * e);
                acc[i][e] += x.x;
                acc[i][e + 1] += x.y;
                acc[i][e + 2] += x.z;
                acc[i][e + 3] += x.w;
            }
            if (row0 + i < n_q) f32_store_row<TE>(db + ((row0 + i) * ldg + ng * 4), acc[i], scale);
        }
    }
}

// ---- Tensor-core path for bf16 / fp16: Hopper wgmma, fp32 accumulation -----------------------
//
// The same three-kernel structure (forward; dK/dV per key block; dQ per query block, delta from
// attention_bwd_delta). A block is one warpgroup (4 warps, 128 threads) owning 64 rows, and every
// product is one wgmma.mma_async per 16 of the reduction: A (the block's rows) from registers, B
// (the streamed tile) from shared memory. The accumulator of m64nNk16 gives warp w rows 16w..16w+15
// in mma.m16n8's C layout, and its A-from-registers layout is mma.m16n8k16's, lane = 4 g + c:
//   A 16x16:  a[0] = (g, 2c..2c+1)  a[1] = (g+8, 2c..)  a[2] = (g, 2c+8..)  a[3] = (g+8, 2c+8..)
//   C 16x8:   c[0..1] = (g, 2c..2c+1)                   c[2..3] = (g+8, 2c..2c+1)
// so the C fragments of two adjacent 16x8 score tiles are the A fragment of the next product
// (flash-attention 2's register reuse: P never touches memory). B is read from shared memory once
// per 64 rows (mma.sync read it once per warp, 16 rows: 4x the shared-memory traffic, the old
// kernels' bound). Every streamed tile (K, V in the forward and dQ; Q, dO in dK/dV) is stored
// row-major in 128-byte-swizzled rows (SwTile) and serves both as a K-major B (Y in X·Yᵀ) and as an
// MN-major B (Y in X·Y, wgmma's transpose bit). Tiles arrive by cp.async into two buffers (tile i+1
// in flight while tile i is computed); each thread fences its copies into the async proxy before
// the barrier that publishes them to wgmma. wgmma is asynchronous: a kernel issues the products
// that do not wait on each other together and works on registers while they run (the forward's
// next scores during this tile's softmax; S and dP together in the backward, dS during dV), then
// waits for them (wg_issue / wg_wait). Scores are kept in log2 units (scale·log2 e folded in) so
// each exponential is one ex2.
//
// Masks (every kernel): query row i sees key j iff j <= i + off and j < n_k; off = 0 is causal
// self-attention, off > 0 a query block after its key block's start (context parallelism), and
// off = n_k full attention. off >= 0, so key 0 is seen by every row: no row's softmax is empty.

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
using u64 = unsigned long long;

template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}
template <> __device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// 2^x as one MUFU.EX2 (flush-to-zero; ex2(-inf) = 0): exp2f without fast math adds a denormal
// fix-up around it, and these kernels' probabilities are rounded to 16 bits for the next product.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

template <typename T> __device__ __forceinline__ u32 ld32(const T* p) {
    return *reinterpret_cast<const u32*>(p);
}

// A row-major [R, D] tile of 16-bit elements in shared memory, as wgmma reads it: column blocks
// of CW = min(D, 64) elements ([D / CW][R][CW], rows of SW = 2 CW bytes), each 16-byte chunk of
// a row XOR-swizzled by the row (Swizzle<log2(SW/16), 4, 3>: address bits 7.. into bits 4..), so
// that the 8 rows of an 8 x SW-byte atom hit distinct banks. The tile's base is 1024-byte aligned.
template <int R, int D> struct SwTile {
    static constexpr int CW = D < 64 ? D : 64;
    static constexpr int SW = 2 * CW;
    static constexpr int BYTES = R * D * 2;
    static_assert(R % 16 == 0 && D % 32 == 0 && BYTES % 1024 == 0, "tiles of whole swizzle atoms");
    // The byte offset of chunk ch (elements 8 ch..8 ch+7) of row r.
    static __device__ __forceinline__ u32 chunk(int r, int ch) {
        const u32 o = (u32)((ch / (CW / 8)) * R * SW + r * SW + (ch % (CW / 8)) * 16);
        return o ^ (((o >> 7) & (SW / 16 - 1)) << 4);
    }
    // wgmma shared-memory descriptor (PTX ISA, "matrix descriptor"): start, leading and stride
    // byte offsets >> 4, swizzle mode in bits 62-63 (1: 128 B, 2: 64 B).
    static __device__ __forceinline__ u64 desc(u32 start, u32 lbo, u32 sbo) {
        constexpr u64 mode = SW == 128 ? 1 : 2;
        return (u64)((start & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (mode << 62);
    }
    // B of X·Yᵀ (this tile is Y: rows are N, columns the reduction), k-step kk (columns 16 kk..):
    // K-major; 8-row groups SBO = 8 SW apart, the k offset inside the swizzled row.
    static __device__ __forceinline__ u64 k_major(u32 base, int kk) {
        return desc(base + (kk * 16 / CW) * R * SW + (kk * 16 % CW) * 2, 16, 8 * SW);
    }
    // B of X·Y (this tile is Y: rows are the reduction, columns N), k-step kk (rows 16 kk..):
    // MN-major; column blocks LBO = R SW apart, 8-row groups SBO = 8 SW apart.
    static __device__ __forceinline__ u64 mn_major(u32 base, int kk) {
        return desc(base + kk * 16 * SW, R * SW, 8 * SW);
    }
};

// Starts copying rows [r0, r0 + R) of a [n, D] matrix with row stride ld into the SwTile at
// shared address dst (zeros past n); the caller commits the group.
template <int R, int D, typename T>
__device__ __forceinline__ void tile_async(u32 dst, const T* __restrict__ src, int ld, int r0, int n) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
    static_assert((R * CH) % kAttnThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int it = 0; it < R * CH / kAttnThreads; ++it) {
        const int i = it * kAttnThreads + threadIdx.x, r = i / CH, ch = i % CH;
        const bool ok = r0 + r < n;
        cp_async16(dst + SwTile<R, D>::chunk(r, ch), src + ((ok ? r0 + r : 0) * ld + ch * 8), ok);
    }
}

// The same for two matrices of one layout (K and V): the offsets are computed once for both.
// tid: this thread's index among the warpgroup's 128 that copy (threadIdx.x in the one-warpgroup kernels).
template <int R, int D, typename T>
__device__ __forceinline__ void tile2_async(u32 dst_a, const T* __restrict__ a, u32 dst_b, const T* __restrict__ b,
                                            int ld, int r0, int n, int tid = threadIdx.x) {
    constexpr int CH = D / 8;
    static_assert((R * CH) % kAttnThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int it = 0; it < R * CH / kAttnThreads; ++it) {
        const int i = it * kAttnThreads + tid, r = i / CH, ch = i % CH;
        const bool ok = r0 + r < n;
        const int off = (ok ? r0 + r : 0) * ld + ch * 8;
        const u32 s = SwTile<R, D>::chunk(r, ch);
        cp_async16(dst_a + s, a + off, ok);
        cp_async16(dst_b + s, b + off, ok);
    }
}

// The same for R floats [r0, r0 + R) of a vector (zeros past n), plain layout.
template <int R>
__device__ __forceinline__ void vec_async(float* dst, const float* __restrict__ src, int r0, int n) {
    for (int i = threadIdx.x; i < R; i += kAttnThreads) {
        const bool ok = r0 + i < n;
        cp_async4(smem_addr(dst + i), src + (ok ? r0 + i : 0), ok);
    }
}

// Waits for this thread's copies and makes them visible to wgmma (the async proxy); the
// barrier after it publishes everyone's.
__device__ __forceinline__ void tiles_landed() {
    cp_async_wait_all();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
}

// The first 1024-byte-aligned shared address in a static buffer (declared 1024 bytes longer).
__device__ __forceinline__ u32 align1024(const void* p) { return (smem_addr(p) + 1023u) & ~1023u; }

// The A fragments of 16 rows [row0, row0 + 16) x D (row stride ld) straight from global memory
// (zeros past n).
template <typename T, int D>
__device__ __forceinline__ void frag_load_a(u32 (&a)[D / 16][4], const T* __restrict__ src, int ld, int row0,
                                            int n) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r_lo = row0 + g, r_hi = row0 + g + 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int col = kk * 16 + 2 * c;
        a[kk][0] = r_lo < n ? ld32(src + (r_lo * ld + col)) : 0u;
        a[kk][1] = r_hi < n ? ld32(src + (r_hi * ld + col)) : 0u;
        a[kk][2] = r_lo < n ? ld32(src + (r_lo * ld + col + 8)) : 0u;
        a[kk][3] = r_hi < n ? ld32(src + (r_hi * ld + col + 8)) : 0u;
    }
}

// wgmma.mma_async m64nNk16, A from registers, B by descriptor, fp32 accumulators c[N/8][4];
// TB = 1 takes B MN-major (wgmma's transpose bit), acc = 0 overwrites c.
template <typename T, int N> struct Wgmma;
template <> struct Wgmma<__nv_bfloat16, 16> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[2][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, %13;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};
template <> struct Wgmma<__half, 16> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[2][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, %13;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};
template <> struct Wgmma<__nv_bfloat16, 32> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[4][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %22, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, %21;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};
template <> struct Wgmma<__half, 32> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[4][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %22, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, %21;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};
template <> struct Wgmma<__nv_bfloat16, 64> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[8][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};
template <> struct Wgmma<__half, 64> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[8][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};
template <> struct Wgmma<__nv_bfloat16, 128> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[16][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3]), "+f"(c[8][0]), "+f"(c[8][1]), "+f"(c[8][2]), "+f"(c[8][3]), "+f"(c[9][0]), "+f"(c[9][1]), "+f"(c[9][2]), "+f"(c[9][3]), "+f"(c[10][0]), "+f"(c[10][1]), "+f"(c[10][2]), "+f"(c[10][3]), "+f"(c[11][0]), "+f"(c[11][1]), "+f"(c[11][2]), "+f"(c[11][3]), "+f"(c[12][0]), "+f"(c[12][1]), "+f"(c[12][2]), "+f"(c[12][3]), "+f"(c[13][0]), "+f"(c[13][1]), "+f"(c[13][2]), "+f"(c[13][3]), "+f"(c[14][0]), "+f"(c[14][1]), "+f"(c[14][2]), "+f"(c[14][3]), "+f"(c[15][0]), "+f"(c[15][1]), "+f"(c[15][2]), "+f"(c[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};
template <> struct Wgmma<__half, 128> {
    template <int TB> static __device__ __forceinline__ void run(float (&c)[16][4], const u32 (&a)[4], u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3]), "+f"(c[8][0]), "+f"(c[8][1]), "+f"(c[8][2]), "+f"(c[8][3]), "+f"(c[9][0]), "+f"(c[9][1]), "+f"(c[9][2]), "+f"(c[9][3]), "+f"(c[10][0]), "+f"(c[10][1]), "+f"(c[10][2]), "+f"(c[10][3]), "+f"(c[11][0]), "+f"(c[11][1]), "+f"(c[11][2]), "+f"(c[11][3]), "+f"(c[12][0]), "+f"(c[12][1]), "+f"(c[12][2]), "+f"(c[12][3]), "+f"(c[13][0]), "+f"(c[13][1]), "+f"(c[13][2]), "+f"(c[13][3]), "+f"(c[14][0]), "+f"(c[14][1]), "+f"(c[14][2]), "+f"(c[14][3]), "+f"(c[15][0]), "+f"(c[15][1]), "+f"(c[15][2]), "+f"(c[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(acc));
    }
};

// Keeps the compiler from moving reads or writes of these registers across the asm around them
// (wgmma's accumulators are written asynchronously, until wgmma.wait_group).
template <int N> __device__ __forceinline__ void fence_regs(float (&c)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(c[j][e])::"memory");
}

// acc[N/8][4] += A[64, K] · B for the block's warpgroup, issued (not waited for): A given as
// fragments a[K/16][4], B the SwTile at shared address b, read K-major (TB = 0: the tile is Bᵀ,
// [N][K]) or MN-major (TB = 1: the tile is B, [K][N]). acc and a belong to the tensor cores until
// wg_wait: several products can be in flight while the warps compute something else. Overwrite = true
// makes it acc = A · B (the first k-step ignores acc's values: no zeroing needed).
template <typename T, int N, int K, int R, int D, int TB, bool Overwrite = false>
__device__ __forceinline__ void wg_issue(float (&acc)[N / 8][4], const u32 (&a)[K / 16][4], u32 b) {
    static_assert(TB ? (R == K && D == N) : (R == N && D == K), "the tile's shape is B's");
    fence_regs(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        Wgmma<T, N>::template run<TB>(acc, a[kk], TB ? SwTile<R, D>::mn_major(b, kk) : SwTile<R, D>::k_major(b, kk),
                                      !Overwrite || kk > 0);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most G of this warpgroup's issued products are still in flight (they complete
// in order); fence_regs on an accumulator then hands it back to the warps.
template <int G> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(G) : "memory");
}

// The product, waited for.
template <typename T, int N, int K, int R, int D, int TB>
__device__ __forceinline__ void wg_mma(float (&acc)[N / 8][4], const u32 (&a)[K / 16][4], u32 b) {
    wg_issue<T, N, K, R, D, TB>(acc, a, b);
    wg_wait<0>();
    fence_regs(acc);
}

// The A fragments of P[16, K] given as C fragments p[K/8][4] (fp32), rounded to T.
template <typename T, int K>
__device__ __forceinline__ void c_to_a(u32 (&a)[K / 16][4], const float (&p)[K / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        a[kk][0] = pack2<T>(p[2 * kk][0], p[2 * kk][1]);
        a[kk][1] = pack2<T>(p[2 * kk][2], p[2 * kk][3]);
        a[kk][2] = pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[kk][3] = pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
    }
}

template <int N> __device__ __forceinline__ void zero_acc(float (&acc)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
}

// Four 32-bit values of each lane of a quad (x[i] of lane c, M[c][i]) transposed across the quad: lane c
// ends with M[i][c] in x[i]. Two butterfly rounds of shuffles (lane bit b against index bit b); every
// index is a compile-time one (selects, no local memory). All 32 lanes take part.
__device__ __forceinline__ void quad_transpose(u32 (&x)[4], int c) {
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
        const bool upper = c & m;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i & m) continue;
            const u32 recv = __shfl_xor_sync(0xffffffffu, upper ? x[i] : x[i | m], m);
            if (upper) x[i] = recv;
            else x[i | m] = recv;
        }
    }
}

// Rows [row0, row0 + 16) of acc (C fragments, [16, D]) times `mul`, stored as T (row stride ld)
// where row < n. Wide (for outputs the launcher allocates, whose address and row stride are 16-byte
// aligned: the forwards'): each quad transposes its pairs of columns so that a lane writes 8 columns
// (16 bytes) at once, whole 32-byte sectors, where the fragments' own 4-byte stores write half
// sectors (Nsight Compute: 49% excess sectors in the forward's output stores). Not for the
// backwards' stores, into views the caller may give: their 4-byte stores need 4-byte alignment
// only, and the dK/dV kernel at D = 128 spills more with both paths.
template <typename T, int D, bool Wide = false>
__device__ __forceinline__ void frag_store(T* __restrict__ dst, int ld, const float (&acc)[D / 8][4], int row0, int n,
                                           float mul_lo, float mul_hi) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r_lo = row0 + g, r_hi = row0 + g + 8;
    if constexpr (Wide) {
        static_assert(sizeof(T) == 2 && D % 32 == 0, "pairs of 16-bit columns, 4 column groups a quad");
#pragma unroll
        for (int j0 = 0; j0 < D / 8; j0 += 4) {
            u32 lo[4], hi[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[i] = pack2<T>(acc[j0 + i][0] * mul_lo, acc[j0 + i][1] * mul_lo);
                hi[i] = pack2<T>(acc[j0 + i][2] * mul_hi, acc[j0 + i][3] * mul_hi);
            }
            quad_transpose(lo, c);  // lane c: columns (j0 + c) * 8 + 0..7 of its rows
            quad_transpose(hi, c);
            const int col = (j0 + c) * 8;
            if (r_lo < n) *reinterpret_cast<uint4*>(dst + (r_lo * ld + col)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
            if (r_hi < n) *reinterpret_cast<uint4*>(dst + (r_hi * ld + col)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int col = j * 8 + 2 * c;
            if (r_lo < n)
                *reinterpret_cast<u32*>(dst + (r_lo * ld + col)) = pack2<T>(acc[j][0] * mul_lo, acc[j][1] * mul_lo);
            if (r_hi < n)
                *reinterpret_cast<u32*>(dst + (r_hi * ld + col)) = pack2<T>(acc[j][2] * mul_hi, acc[j][3] * mul_hi);
        }
    }
}

constexpr int kTcRows = KILN_ATTN_TC_ROWS;  // rows per block in every tensor-core kernel: one warpgroup, 4 x 16

template <int D> struct TcShape {
    // Rows per streamed tile: keys in the forward and dQ, queries in dK/dV. Two buffers of two
    // tiles keep static shared memory under 48 KiB. dK/dV's rows come from the launcher
    // (attention.py's DKDV_DEFAULT, or the KILN_ATTENTION_DKDV_TILES knob): at D = 128 (K, V fragments
    // and both accumulators in registers) 32 rows spill 8 bytes and still beat 16.
    static constexpr int fwd_k = D >= 128 ? 32 : 64;
    static constexpr int dkdv_q = D >= 128 ? KILN_ATTN_DKDV_Q_D128 : KILN_ATTN_DKDV_Q;
    // The fused backward's query rows, fixed (its dQᵀ products take 64 at D = 64; 16 at D = 128).
    static constexpr int fused_q = D >= 128 ? KILN_ATTN_FUSED_Q_D128 : KILN_ATTN_FUSED_Q;
    static constexpr int dq_k = D >= 128 ? 32 : 64;
    // Resident blocks per SM the forward asks ptxas for at D = 64: 3 (up to 168 registers: two
    // score tiles are live while the next one is computed).
    static constexpr int fwd_blocks = D == 64 ? 3 : 1;
    // And dQ at D = 64: 3 (it uses 176 registers without the bound, 2 blocks).
    static constexpr int dq_blocks = D == 64 ? 3 : 1;
    // dK/dV asks for none by default (KILN_ATTENTION_DKDV_TILES, a tuning knob, may ask)
    static constexpr int dkdv_blocks = D >= 128 ? KILN_ATTN_DKDV_BLOCKS_D128 : KILN_ATTN_DKDV_BLOCKS;
};

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads, TcShape<D>::fwd_blocks)
    attention_fwd_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                     float* __restrict__ lse, int n_q, int n_k, int off, int n_h, float scale, KILN_LAYOUT(q),
                     KILN_LAYOUT(kv), KILN_LAYOUT(o), int group) {
    const GroupedJob jb = grid_job(group);
    constexpr int BN = TcShape<D>::fwd_k;
    using Tile = SwTile<BN, D>;
    __shared__ __align__(1024) unsigned char smem[4 * Tile::BYTES + 1024];  // K[2], V[2]
    const u32 ks = align1024(smem), vs = ks + 2 * Tile::BYTES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    // k + base, v + base each time (not offset pointers kept live): at D = 64 every register counts
    const long long base = head_offset(jb.bh, n_h, kv_sb, kv_sh);
    const int ld_kv = (int)kv_st;
    const int m0 = (gridDim.x - 1 - jb.rank) * kTcRows;  // the longest rows first
    const int row0 = m0 + warp * 16, r_lo = row0 + g, r_hi = r_lo + 8;
    const float sl2 = scale * kLog2e;
    const int k_end = min(n_k, min(m0 + kTcRows, n_q) - 1 + off + 1);  // keys some row of the block sees
    const int n_tiles = (k_end - 1) / BN + 1;
    // K runs one tile ahead of V: iteration it holds K(it + 1) and V(it) and issues the next
    // scores S(it + 1) = Q·K(it + 1)ᵀ before the softmax of S(it), so that the tensor cores compute
    // them while the warps exponentiate (flash-attention 3's overlap inside a warpgroup).
    tile_async<BN, D>(ks, k + base, ld_kv, 0, n_k);
    cp_async_commit();  // K(0)
    if (n_tiles > 1) tile_async<BN, D>(ks + Tile::BYTES, k + base, ld_kv, BN, n_k);
    tile_async<BN, D>(vs, v + base, ld_kv, 0, n_k);
    cp_async_commit();  // K(1), V(0)
    u32 qa[D / 16][4];
    frag_load_a<T, D>(qa, q + head_offset(jb.bh, n_h, q_sb, q_sh), (int)q_st, row0, n_q);
    float o[D / 8][4];
    zero_acc(o);
    float m_lo = -KILN_INF, m_hi = -KILN_INF, l_lo = 0.0f, l_hi = 0.0f;
    cp_async_wait_group<1>();  // K(0)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float s[BN / 8][4];
    zero_acc(s);
    wg_mma<T, BN, D, BN, D, 0>(s, qa, ks);
    for (int it = 0; it < n_tiles; ++it) {
        const int n0 = it * BN, buf = it & 1;
        // K(it + 1) and V(it) have landed for everyone, and everyone's S(it) and P·V(it - 1) are
        // done: K(it)'s and V(it - 1)'s buffers take K(it + 2) and V(it + 1).
        tiles_landed();
        if (it + 2 < n_tiles) tile_async<BN, D>(ks + buf * Tile::BYTES, k + base, ld_kv, n0 + 2 * BN, n_k);
        if (it + 1 < n_tiles) tile_async<BN, D>(vs + (buf ^ 1) * Tile::BYTES, v + base, ld_kv, n0 + BN, n_k);
        cp_async_commit();
        const bool next = it + 1 < n_tiles;
        float sn[BN / 8][4];
        if (next) {
            zero_acc(sn);
            wg_issue<T, BN, D, BN, D, 0>(sn, qa, ks + (buf ^ 1) * Tile::BYTES);
        }
        // some key of this tile is hidden from some row of this warp
        const bool edge = n0 + BN - 1 > row0 + off || n0 + BN > n_k;
        float mx_lo = -KILN_INF, mx_hi = -KILN_INF;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + j * 8 + 2 * c + (e & 1);
                const int row = e < 2 ? r_lo : r_hi;
                s[j][e] = (edge && (key > row + off || key >= n_k)) ? -KILN_INF : s[j][e] * sl2;
            }
            mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
        }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o_));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o_));
        }
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        // A row with every key masked so far keeps m = -inf; its exponentials are then all 0.
        const float sub_lo = mn_lo == -KILN_INF ? 0.0f : mn_lo, sub_hi = mn_hi == -KILN_INF ? 0.0f : mn_hi;
        const float a_lo = ex2(m_lo - sub_lo), a_hi = ex2(m_hi - sub_hi);
        m_lo = mn_lo;
        m_hi = mn_hi;
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            s[j][0] = ex2(s[j][0] - sub_lo);
            s[j][1] = ex2(s[j][1] - sub_lo);
            s[j][2] = ex2(s[j][2] - sub_hi);
            s[j][3] = ex2(s[j][3] - sub_hi);
            sum_lo += s[j][0] + s[j][1];
            sum_hi += s[j][2] + s[j][3];
        }
        l_lo = l_lo * a_lo + sum_lo;  // this lane's part of the row sum; the quad is summed at the end
        l_hi = l_hi * a_hi + sum_hi;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[j][0] *= a_lo;
            o[j][1] *= a_lo;
            o[j][2] *= a_hi;
            o[j][3] *= a_hi;
        }
        u32 pa[BN / 16][4];
        c_to_a<T, BN>(pa, s);
        wg_issue<T, D, BN, BN, D, 1>(o, pa, vs + buf * Tile::BYTES);
        wg_wait<0>();
        fence_regs(o);
        if (next) {
            fence_regs(sn);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] = sn[j][e];
        }
    }
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o_);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o_);
    }
    const GroupedJob tail = grid_job(group);  // read afresh, not kept across the loop
    frag_store<T, D, true>(out + head_offset(tail.bh, n_h, o_sb, o_sh), (int)o_st, o, row0, n_q, 1.0f / l_lo,
                           1.0f / l_hi);
    if (c == 0) {
        const long long lb = (long long)tail.bh * n_q;
        if (r_lo < n_q) lse[lb + r_lo] = (m_lo + log2f(l_lo)) * kLn2;
        if (r_hi < n_q) lse[lb + r_hi] = (m_hi + log2f(l_hi)) * kLn2;
    }
}

// wgmma.mma_async m64nNk16, A and B both by descriptor; TA = 1 takes A M-major (the tile is Aᵀ).
template <typename T, int N> struct WgmmaSS;
template <> struct WgmmaSS<__nv_bfloat16, 16> {
    template <int TA, int TB> static __device__ __forceinline__ void run(float (&c)[2][4], u64 adesc, u64 bdesc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %12, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %10, %11;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3])
                     : "l"(adesc), "l"(bdesc), "n"(TA), "n"(TB), "r"(acc));
    }
};
template <> struct WgmmaSS<__half, 16> {
    template <int TA, int TB> static __device__ __forceinline__ void run(float (&c)[2][4], u64 adesc, u64 bdesc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %12, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %10, %11;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3])
                     : "l"(adesc), "l"(bdesc), "n"(TA), "n"(TB), "r"(acc));
    }
};
template <> struct WgmmaSS<__nv_bfloat16, 64> {
    template <int TA, int TB> static __device__ __forceinline__ void run(float (&c)[8][4], u64 adesc, u64 bdesc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %34, %35;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
                     : "l"(adesc), "l"(bdesc), "n"(TA), "n"(TB), "r"(acc));
    }
};
template <> struct WgmmaSS<__half, 64> {
    template <int TA, int TB> static __device__ __forceinline__ void run(float (&c)[8][4], u64 adesc, u64 bdesc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %34, %35;\n}\n"
                     : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
                     : "l"(adesc), "l"(bdesc), "n"(TA), "n"(TB), "r"(acc));
    }
};

// acc[N/8][4] (+)= A[64, K] · B, both read from SwTiles in shared memory at a and b (A: rows M, read
// K-major, or with TA = 1 rows K, M-major; B as wg_issue's), issued and committed, not waited for;
// first = 0 overwrites acc (the first k-step's scale-d is 0).
template <typename T, int N, int K, typename ATile, typename BTile, int TA, int TB>
__device__ __forceinline__ void wg_issue_ss(float (&acc)[N / 8][4], u32 a, u32 b, int first) {
    fence_regs(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        WgmmaSS<T, N>::template run<TA, TB>(acc, TA ? ATile::mn_major(a, kk) : ATile::k_major(a, kk),
                                            TB ? BTile::mn_major(b, kk) : BTile::k_major(b, kk), kk > 0 || first);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Sᵀ = K·Qᵀ or dPᵀ = V·dOᵀ of a warpgroup's 64 keys (as wg_issue, overwriting acc where Overwrite): K (V) as
// the A operand from this warp's fragments in registers, or from the warpgroup's SwTile<kTcRows, D> at a shared
// address (the dK/dV kernel with TMA at D = 128, whose registers do not hold K and V besides dK and dV).
template <typename T, int BQ, int D, bool Overwrite>
__device__ __forceinline__ void key_rows_issue(float (&acc)[BQ / 8][4], const u32 (&a)[D / 16][4], u32 b) {
    wg_issue<T, BQ, D, BQ, D, 0, Overwrite>(acc, a, b);
}
template <typename T, int BQ, int D, bool Overwrite>
__device__ __forceinline__ void key_rows_issue(float (&acc)[BQ / 8][4], u32 a, u32 b) {
    wg_issue_ss<T, BQ, D, SwTile<kTcRows, D>, SwTile<BQ, D>, 0, 0>(acc, a, b, Overwrite ? 0 : 1);
}

// Stores the 16 x BQ tile of dSᵀ a warp holds as A fragments (c_to_a's da: rows = keys key0..key0+15
// of the block, columns = the tile's queries) transposed into the SwTile<BQ, 64> at shared address
// dst, rows = queries, columns = keys: stmatrix .trans writes each 8 x 8 piece as its transpose,
// lane l giving the address of row l & 7 of piece l >> 3 (pieces: keys lo/hi x queries lo/hi).
template <int BQ>
__device__ __forceinline__ void ds_store_t(u32 dst, const u32 (&da)[BQ / 16][4], int key0) {
    const int lane = threadIdx.x & 31;
    const int r = (lane & 7) + ((lane >> 4) << 3), ch = key0 / 8 + ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     ::"r"(dst + SwTile<BQ, kTcRows>::chunk(kk * 16 + r, ch)), "r"(da[kk][0]), "r"(da[kk][1]),
                       "r"(da[kk][2]), "r"(da[kk][3]) : "memory");
}

// One tile of the dK/dV kernels (attention_bwd_dkdv_tc, attention_bwd_dkdv_tma), a warpgroup's 64 keys against
// BQ queries q0..: Sᵀ = K·Qᵀ, Pᵀ = exp(Sᵀ - lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - delta), dK += dSᵀ·Q.
// ka, va: this warp's K and V rows as A fragments, or the warpgroup's K and V tiles' shared addresses
// (key_rows_issue); qb, gb: the Q and dO tiles in shared memory; ls, ds_row: the
// tile's lse (times lse_scale gives log2 units) and delta in shared memory. Sᵀ and dPᵀ are issued together; P is
// formed while dPᵀ runs, dSᵀ while dV += Pᵀ·dO runs. They overwrite p and ds (scale-d 0 at the first k-step),
// except at D = 128, where ptxas then serialised the products for want of registers (C7512): zeroed there,
// before S is issued.
// StoreDs (the fused dK/dV/dQ kernel): dSᵀ, rounded to T, also goes transposed to the SwTile<BQ, 64> at ds_dst
// (ds_store_t), the B of the warpgroup's dQᵀ = Kᵀ·dSᵀ.
template <typename T, int BQ, int D, typename KeyRows, bool StoreDs = false>
__device__ __forceinline__ void dkdv_tile(float (&dk_acc)[D / 8][4], float (&dv_acc)[D / 8][4],
                                          const KeyRows& ka, const KeyRows& va, u32 qb, u32 gb,
                                          const float* ls, const float* ds_row, float lse_scale, int q0, int key0,
                                          int n_q, int off, float sl2, u32 ds_dst = 0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, key_lo = key0 + g, key_hi = key_lo + 8;
    // Masks are needed only where some query of the tile misses some key of this warp, or past n_q.
    const bool edge = q0 + off < key0 + 15 || q0 + BQ > n_q;
    constexpr bool kOverwrite = D < 128;
    float p[BQ / 8][4], ds[BQ / 8][4];
    if constexpr (!kOverwrite) {
        zero_acc(p);
        zero_acc(ds);
        fence_regs(ds);  // not while S runs (ptxas would wait for it)
    }
    key_rows_issue<T, BQ, D, kOverwrite>(p, ka, qb);   // Sᵀ = K·Qᵀ
    key_rows_issue<T, BQ, D, kOverwrite>(ds, va, gb);  // dPᵀ = V·dOᵀ
    wg_wait<1>();
    fence_regs(p);
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) {
        const float2 lq = *reinterpret_cast<const float2*>(&ls[j * 8 + 2 * c]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int query = q0 + j * 8 + 2 * c + (e & 1), key = e < 2 ? key_lo : key_hi;
            const float x = ex2(p[j][e] * sl2 - ((e & 1) ? lq.y : lq.x) * lse_scale);
            p[j][e] = (!edge || (key <= query + off && query < n_q)) ? x : 0.0f;
        }
    }
    u32 pa[BQ / 16][4];
    c_to_a<T, BQ>(pa, p);
    wg_wait<0>();
    fence_regs(ds);
    wg_issue<T, D, BQ, BQ, D, 1>(dv_acc, pa, gb);  // dV += Pᵀ·dO, while dSᵀ is formed
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) {
        const float2 dl = *reinterpret_cast<const float2*>(&ds_row[j * 8 + 2 * c]);
        ds[j][0] = p[j][0] * (ds[j][0] - dl.x);
        ds[j][1] = p[j][1] * (ds[j][1] - dl.y);
        ds[j][2] = p[j][2] * (ds[j][2] - dl.x);
        ds[j][3] = p[j][3] * (ds[j][3] - dl.y);
    }
    u32 da[BQ / 16][4];
    c_to_a<T, BQ>(da, ds);
    wg_issue<T, D, BQ, BQ, D, 1>(dk_acc, da, qb);  // dK += dSᵀ·Q
    if constexpr (StoreDs) ds_store_t<BQ>(ds_dst, da, ((threadIdx.x >> 5) & 3) * 16);
    wg_wait<0>();
    fence_regs(dv_acc);
    fence_regs(dk_acc);
}

// One tile of the dQ kernels (attention_bwd_dq_tc, attention_bwd_dq_tma), a warp's 16 rows row0.. against BN keys
// n0..: S = Q·Kᵀ, P = exp(S - lse), dP = dO·Vᵀ, dS = P∘(dP - delta), dQ += dS·K (waited for). qa, ga: the rows'
// Q and dO as A fragments; kb, vb: the K and V tiles in shared memory; lse (log2 units) and delta of rows
// row0 + g and row0 + g + 8. S and dP are issued together (overwriting p and ds); P is formed while dP runs.
template <typename T, int BN, int D>
__device__ __forceinline__ void dq_tile(float (&dq_acc)[D / 8][4], const u32 (&qa)[D / 16][4],
                                        const u32 (&ga)[D / 16][4], u32 kb, u32 vb, int n0, int row0, int n_k,
                                        int off, float sl2, float lse_lo, float lse_hi, float dl_lo, float dl_hi) {
    const int lane = threadIdx.x & 31, c = lane & 3, r_lo = row0 + (lane >> 2), r_hi = r_lo + 8;
    const bool edge = n0 + BN - 1 > row0 + off || n0 + BN > n_k;  // some key of the tile hidden from some row
    float p[BN / 8][4], ds[BN / 8][4];
    wg_issue<T, BN, D, BN, D, 0, true>(p, qa, kb);   // S = Q·Kᵀ
    wg_issue<T, BN, D, BN, D, 0, true>(ds, ga, vb);  // dP = dO·Vᵀ
    wg_wait<1>();
    fence_regs(p);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = n0 + j * 8 + 2 * c + (e & 1);
            const int row = e < 2 ? r_lo : r_hi;
            const float x = ex2(p[j][e] * sl2 - (e < 2 ? lse_lo : lse_hi));
            p[j][e] = (!edge || (key <= row + off && key < n_k)) ? x : 0.0f;
        }
    }
    wg_wait<0>();
    fence_regs(ds);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        ds[j][0] = p[j][0] * (ds[j][0] - dl_lo);
        ds[j][1] = p[j][1] * (ds[j][1] - dl_lo);
        ds[j][2] = p[j][2] * (ds[j][2] - dl_hi);
        ds[j][3] = p[j][3] * (ds[j][3] - dl_hi);
    }
    u32 da[BN / 16][4];
    c_to_a<T, BN>(da, ds);
    wg_mma<T, D, BN, BN, D, 1>(dq_acc, da, kb);  // dQ += dS·K
}

// dK, dV for one block of 64 keys (each warp 16), walking the query tiles that see it:
// Sᵀ = K·Qᵀ, Pᵀ = exp(Sᵀ - lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - delta), dK += dSᵀ·Q.
template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads, TcShape<D>::dkdv_blocks) attention_bwd_dkdv_tc(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
    int n_q, int n_k, int off, int n_h, float scale, KILN_LAYOUT(q), KILN_LAYOUT(kv), KILN_LAYOUT(o),
    KILN_LAYOUT(dkv), int group) {
    const GroupedJob jb = grid_job(group);
    constexpr int BQ = TcShape<D>::dkdv_q;
    using Tile = SwTile<BQ, D>;
    __shared__ __align__(1024) unsigned char smem[4 * Tile::BYTES + 1024];  // Q[2], dO[2]
    __shared__ __align__(16) float Ls[2][BQ];
    __shared__ __align__(16) float Ds[2][BQ];
    const u32 qs = align1024(smem), gs = qs + 2 * Tile::BYTES;
    const int warp = threadIdx.x >> 5;
    q += head_offset(jb.bh, n_h, q_sb, q_sh);
    const long long kvbase = head_offset(jb.bh, n_h, kv_sb, kv_sh);
    k += kvbase;
    v += kvbase;
    grad += head_offset(jb.bh, n_h, o_sb, o_sh);
    const long long gbase = head_offset(jb.bh, n_h, dkv_sb, dkv_sh);
    dk += gbase;
    dv += gbase;
    lse += (long long)jb.bh * n_q;
    delta += (long long)jb.bh * n_q;
    const int ld_q = (int)q_st, ld_o = (int)o_st;
    const int n0 = jb.rank * kTcRows;  // the first key blocks walk the most query tiles: rank 0
    const int key0 = n0 + warp * 16;
    const float sl2 = scale * kLog2e;
    const int q_begin = (max(n0 - off, 0) / BQ) * BQ;  // the first query tile that sees key n0
    const int n_tiles = q_begin < n_q ? (n_q - q_begin + BQ - 1) / BQ : 0;
    if (n_tiles > 0) {
        tile_async<BQ, D>(qs, q, ld_q, q_begin, n_q);
        tile_async<BQ, D>(gs, grad, ld_o, q_begin, n_q);
        vec_async<BQ>(Ls[0], lse, q_begin, n_q);
        vec_async<BQ>(Ds[0], delta, q_begin, n_q);
        cp_async_commit();
    }
    u32 ka[D / 16][4], va[D / 16][4];
    frag_load_a<T, D>(ka, k, (int)kv_st, key0, n_k);
    frag_load_a<T, D>(va, v, (int)kv_st, key0, n_k);
    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    zero_acc(dk_acc);
    zero_acc(dv_acc);
    for (int it = 0; it < n_tiles; ++it) {
        const int q0 = q_begin + it * BQ, buf = it & 1;
        const u32 qb = qs + buf * Tile::BYTES, gb = gs + buf * Tile::BYTES;
        tiles_landed();  // tile it has landed for everyone, and everyone is done with tile it - 1
        if (it + 1 < n_tiles) {
            tile_async<BQ, D>(qs + (buf ^ 1) * Tile::BYTES, q, ld_q, q0 + BQ, n_q);
            tile_async<BQ, D>(gs + (buf ^ 1) * Tile::BYTES, grad, ld_o, q0 + BQ, n_q);
            vec_async<BQ>(Ls[buf ^ 1], lse, q0 + BQ, n_q);
            vec_async<BQ>(Ds[buf ^ 1], delta, q0 + BQ, n_q);
            cp_async_commit();
        }
        dkdv_tile<T, BQ, D>(dk_acc, dv_acc, ka, va, qb, gb, Ls[buf], Ds[buf], kLog2e, q0, key0, n_q, off, sl2);
    }
    frag_store<T, D>(dk, (int)dkv_st, dk_acc, key0, n_k, scale, scale);
    frag_store<T, D>(dv, (int)dkv_st, dv_acc, key0, n_k, 1.0f, 1.0f);
}

// dQ for one block of 64 queries (each warp 16), walking the key tiles it sees:
// S = Q·Kᵀ, P = exp(S - lse), dP = dO·Vᵀ, dS = P∘(dP - delta), dQ += dS·K.
template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads, TcShape<D>::dq_blocks) attention_bwd_dq_tc(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int n_q, int n_k, int off,
    int n_h, float scale, KILN_LAYOUT(q), KILN_LAYOUT(kv), KILN_LAYOUT(o), KILN_LAYOUT(dq), int group) {
    const GroupedJob jb = grid_job(group);
    constexpr int BN = TcShape<D>::dq_k;
    using Tile = SwTile<BN, D>;
    __shared__ __align__(1024) unsigned char smem[4 * Tile::BYTES + 1024];  // K[2], V[2]
    const u32 ks = align1024(smem), vs = ks + 2 * Tile::BYTES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const long long kvbase = head_offset(jb.bh, n_h, kv_sb, kv_sh);
    k += kvbase;
    v += kvbase;
    lse += (long long)jb.bh * n_q;
    delta += (long long)jb.bh * n_q;
    const int ld_kv = (int)kv_st;
    const int m0 = (gridDim.x - 1 - jb.rank) * kTcRows;  // the longest rows first
    const int row0 = m0 + warp * 16, r_lo = row0 + g, r_hi = r_lo + 8;
    const float sl2 = scale * kLog2e;
    const int k_end = min(n_k, min(m0 + kTcRows, n_q) - 1 + off + 1);  // keys some row of the block sees
    const int n_tiles = (k_end - 1) / BN + 1;
    tile2_async<BN, D>(ks, k, vs, v, ld_kv, 0, n_k);
    cp_async_commit();
    u32 qa[D / 16][4], ga[D / 16][4];
    frag_load_a<T, D>(qa, q + head_offset(jb.bh, n_h, q_sb, q_sh), (int)q_st, row0, n_q);
    frag_load_a<T, D>(ga, grad + head_offset(jb.bh, n_h, o_sb, o_sh), (int)o_st, row0, n_q);
    const float lse_lo = r_lo < n_q ? lse[r_lo] * kLog2e : 0.0f;
    const float lse_hi = r_hi < n_q ? lse[r_hi] * kLog2e : 0.0f;
    const float dl_lo = r_lo < n_q ? delta[r_lo] : 0.0f;
    const float dl_hi = r_hi < n_q ? delta[r_hi] : 0.0f;
    float dq_acc[D / 8][4];
    zero_acc(dq_acc);
    for (int it = 0; it < n_tiles; ++it) {
        const int n0 = it * BN, buf = it & 1;
        const u32 kb = ks + buf * Tile::BYTES, vb = vs + buf * Tile::BYTES;
        tiles_landed();  // tile it has landed for everyone, and everyone is done with tile it - 1
        if (it + 1 < n_tiles) {
            tile2_async<BN, D>(ks + (buf ^ 1) * Tile::BYTES, k, vs + (buf ^ 1) * Tile::BYTES, v, ld_kv, n0 + BN, n_k);
            cp_async_commit();
        }
        dq_tile<T, BN, D>(dq_acc, qa, ga, kb, vb, n0, row0, n_k, off, sl2, lse_lo, lse_hi, dl_lo, dl_hi);
    }
    const GroupedJob tail = grid_job(group);  // read afresh, not kept across the loop
    frag_store<T, D>(dq + head_offset(tail.bh, n_h, dq_sb, dq_sh), (int)dq_st, dq_acc, row0, n_q, scale, scale);
}

// ---- The fused backward: dK, dV and dQ in one kernel, dQ added in any order --------------------
//
// attention_bwd_fused_tc is attention_bwd_dkdv_tc (a block owns 64 keys, walks the query tiles that
// see them: S and dP computed once) that also forms each tile's dQ contribution, dQᵀ = Kᵀ·dSᵀ
// (D x BQ: dSᵀ is in registers by key rows, so it goes to shared memory and both operands of this
// product are read from there: Kᵀ MN-major, wgmma's transpose bit for A; dS K-major), and adds it
// into an fp32 accumulator in global memory. 5 products per tile instead of the split kernels' 4 + 3.
// Each key block adds its tile of dQ as soon as its products are done: staged in shared memory,
// fragment-major, and added by one cp.reduce.async.bulk (flash-attention 3's dQ accumulation), in
// whatever order the blocks run, into an accumulator [B·H, n_qt, BQ·D] the launcher zeroes;
// attention_bwd_dq_store then writes dq. No block waits for another; the sums' order is the
// hardware's, so dq's last bits vary from run to run (dK and dV do not: a block owns them).
// (Measured on an H100, 2026-12-06, the paper's shapes: adding in a fixed order behind a semaphore
// per query tile took 1.2-3.8x this kernel's time, RED per element instead of the bulk reduction
// 1.03-1.20x. Against the split kernels this one wins only at D = 64 and T >= 2048. That fixed order was
// ascending key blocks, against the walk: benchmarks/attention_fused_schedule.py models the descending
// order, in which no block waits, at 0.71-0.80x the split's time; benchmarks/results/attention/NOTES.md.)
// Head dims that are multiples of 64 (the M of dQᵀ's wgmma is D, 64 rows per product).

__device__ __forceinline__ void sts128(u32 addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// A tile's dQ (dqt[D / 64][BQ / 8][4], the C fragments of thread t of its warpgroup) into the stage at shared
// address dst, fragment-major: float4 f of thread t at (f · 128 + t) · 16 bytes; fenced for the bulk copy.
// Add: added to what the stage holds (the other warpgroup's dQ of the same tile, in a fixed order).
template <int BQ, int D, bool Add = false>
__device__ __forceinline__ void stage_dq(u32 dst, const float (&dqt)[D / 64][BQ / 8][4], int t) {
#pragma unroll
    for (int mb = 0; mb < D / 64; ++mb)
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
            const u32 at = dst + ((mb * (BQ / 8) + j) * kAttnThreads + t) * 16;
            float x0 = dqt[mb][j][0], x1 = dqt[mb][j][1], x2 = dqt[mb][j][2], x3 = dqt[mb][j][3];
            if constexpr (Add) {
                float y0, y1, y2, y3;
                asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(y0), "=f"(y1), "=f"(y2), "=f"(y3) : "r"(at) : "memory");
                x0 = y0 + x0;
                x1 = y1 + x1;
                x2 = y2 + x2;
                x3 = y3 + x3;
            }
            sts128(at, x0, x1, x2, x3);
        }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Adds the staged dQ of the query tile at q0 into the accumulator (one thread), committed as a bulk group.
template <int BQ, int D>
__device__ __forceinline__ void reduce_dq(float* dq_acc, int q0, u32 src) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dq_acc + (long long)(q0 / BQ) * BQ * D), "r"(src), "n"(BQ * D * 4) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) attention_bwd_fused_tc(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
    float* __restrict__ dq_acc, int n_bh, int n_q, int n_k, int off, int n_h, float scale, KILN_LAYOUT(q),
    KILN_LAYOUT(kv), KILN_LAYOUT(o), KILN_LAYOUT(dkv)) {
    static_assert(D % 64 == 0, "dQᵀ's products are 64 rows of D each");
    constexpr int BQ = TcShape<D>::fused_q;
    using Tile = SwTile<BQ, D>;         // Q and dO, two buffers each
    using KTile = SwTile<kTcRows, D>;   // K: Kᵀ is the A of dQᵀ
    using STile = SwTile<BQ, kTcRows>;  // dS [BQ queries][64 keys]: the B of dQᵀ
    extern __shared__ unsigned char dsmem[];  // the launcher's fused_shared_bytes
    __shared__ __align__(16) float Ls[2][BQ];
    __shared__ __align__(16) float Ds[2][BQ];
    const u32 qs = align1024(dsmem), gs = qs + 2 * Tile::BYTES, ks = gs + 2 * Tile::BYTES, ss = ks + KTile::BYTES;
    constexpr u32 STAGE_BYTES = BQ * D * 4;
    const u32 stage = ss + STile::BYTES;  // two tiles' dQ, fragment-major, for the bulk reductions
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int n_qt = (n_q + BQ - 1) / BQ;
    // Key block 0 of every head first, the blocks with the most query tiles (as dkdv's launch order).
    const int kb = (int)blockIdx.x / n_bh, bh = (int)blockIdx.x % n_bh;
    dq_acc += (long long)bh * (n_qt * BQ) * D;
    q += head_offset(bh, n_h, q_sb, q_sh);
    const long long kvbase = head_offset(bh, n_h, kv_sb, kv_sh);
    k += kvbase;
    v += kvbase;
    grad += head_offset(bh, n_h, o_sb, o_sh);
    const long long gbase = head_offset(bh, n_h, dkv_sb, dkv_sh);
    dk += gbase;
    dv += gbase;
    lse += (long long)bh * n_q;
    delta += (long long)bh * n_q;
    const int ld_q = (int)q_st, ld_o = (int)o_st;
    const int n0 = kb * kTcRows;
    const int key0 = n0 + warp * 16, key_lo = key0 + g, key_hi = key_lo + 8;
    const float sl2 = scale * kLog2e;
    // The query tiles from the one of the first query that sees key n0, none if no query does.
    const int q_first = max(n0 - off, 0), q_begin = (q_first / BQ) * BQ;
    const int n_tiles = q_first < n_q ? (n_q - q_begin + BQ - 1) / BQ : 0;
    if (n_tiles > 0) {
        tile_async<kTcRows, D>(ks, k, (int)kv_st, n0, n_k);
        tile_async<BQ, D>(qs, q, ld_q, q_begin, n_q);
        tile_async<BQ, D>(gs, grad, ld_o, q_begin, n_q);
        vec_async<BQ>(Ls[0], lse, q_begin, n_q);
        vec_async<BQ>(Ds[0], delta, q_begin, n_q);
        cp_async_commit();
    }
    u32 va[D / 16][4];  // K is read from its shared tile (for Sᵀ too: registers are short at D = 128)
    frag_load_a<T, D>(va, v, (int)kv_st, key0, n_k);
    float dk_acc[D / 8][4], dv_acc[D / 8][4], dqt[D / 64][BQ / 8][4];
    zero_acc(dk_acc);
    zero_acc(dv_acc);
#pragma unroll
    for (int mb = 0; mb < D / 64; ++mb) zero_acc(dqt[mb]);
    for (int it = 0; it < n_tiles; ++it) {
        const int q0 = q_begin + it * BQ, buf = it & 1;
        const u32 qb = qs + buf * Tile::BYTES, gb = gs + buf * Tile::BYTES;
        tiles_landed();  // tile it has landed, tile it - 1's products are done and its dQ staged, for everyone
        if (threadIdx.x == 0 && it > 0) reduce_dq<BQ, D>(dq_acc, q0 - BQ, stage + ((it - 1) & 1) * STAGE_BYTES);
        if (it + 1 < n_tiles) {
            tile_async<BQ, D>(qs + (buf ^ 1) * Tile::BYTES, q, ld_q, q0 + BQ, n_q);
            tile_async<BQ, D>(gs + (buf ^ 1) * Tile::BYTES, grad, ld_o, q0 + BQ, n_q);
            vec_async<BQ>(Ls[buf ^ 1], lse, q0 + BQ, n_q);
            vec_async<BQ>(Ds[buf ^ 1], delta, q0 + BQ, n_q);
            cp_async_commit();
        }
        // As attention_bwd_dkdv_tc: Sᵀ and dPᵀ issued together, P formed while dPᵀ runs, dSᵀ while dV does.
        const bool edge = q0 + off < key0 + 15 || q0 + BQ > n_q || key0 + 16 > n_k;  // keys past n_k feed dS, hence dQ
        float p[BQ / 8][4], ds[BQ / 8][4];
        zero_acc(p);
        zero_acc(ds);
        fence_regs(ds);
        wg_issue_ss<T, BQ, D, KTile, Tile, 0, 0>(p, ks, qb, 1);
        wg_issue<T, BQ, D, BQ, D, 0>(ds, va, gb);
        wg_wait<1>();
        fence_regs(p);
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
            const float2 lq = *reinterpret_cast<const float2*>(&Ls[buf][j * 8 + 2 * c]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = j * 8 + 2 * c + (e & 1), query = q0 + col;
                const int key = e < 2 ? key_lo : key_hi;
                const float x = ex2(p[j][e] * sl2 - ((e & 1) ? lq.y : lq.x) * kLog2e);
                p[j][e] = (!edge || (key <= query + off && key < n_k && query < n_q)) ? x : 0.0f;
            }
        }
        u32 pa[BQ / 16][4];
        c_to_a<T, BQ>(pa, p);
        wg_wait<0>();
        fence_regs(ds);
        wg_issue<T, D, BQ, BQ, D, 1>(dv_acc, pa, gb);
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
            const float2 dl = *reinterpret_cast<const float2*>(&Ds[buf][j * 8 + 2 * c]);
            ds[j][0] = p[j][0] * (ds[j][0] - dl.x);
            ds[j][1] = p[j][1] * (ds[j][1] - dl.y);
            ds[j][2] = p[j][2] * (ds[j][2] - dl.x);
            ds[j][3] = p[j][3] * (ds[j][3] - dl.y);
        }
        u32 da[BQ / 16][4];
        c_to_a<T, BQ>(da, ds);
        wg_issue<T, D, BQ, BQ, D, 1>(dk_acc, da, qb);
        // dS (rounded to T, as dK's product takes it) into shared memory for dQᵀ = Kᵀ·dSᵀ.
        ds_store_t<BQ>(ss, da, warp * 16);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        if (threadIdx.x == 0)  // the reduction of tile it - 2 has read stage it & 1, filled below
            asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
        __syncthreads();  // dS is everyone's, and the stage free
#pragma unroll
        for (int mb = 0; mb < D / 64; ++mb)  // rows 64 mb.. of dQᵀ: K's column block mb
            wg_issue_ss<T, BQ, kTcRows, KTile, STile, 1, 0>(dqt[mb], ks + mb * kTcRows * KTile::SW, ss, 0);
        wg_wait<0>();
        fence_regs(dv_acc);
        fence_regs(dk_acc);
#pragma unroll
        for (int mb = 0; mb < D / 64; ++mb) fence_regs(dqt[mb]);
        // The tile's dQ to its stage; the next iteration's first barrier publishes it, and its reduction follows.
        stage_dq<BQ, D>(stage + (it & 1) * STAGE_BYTES, dqt, (int)threadIdx.x);
    }
    if (n_tiles > 0) {  // the last tile's reduction
        __syncthreads();
        if (threadIdx.x == 0) {
            reduce_dq<BQ, D>(dq_acc, q_begin + (n_tiles - 1) * BQ, stage + ((n_tiles - 1) & 1) * STAGE_BYTES);
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        }
    }
    frag_store<T, D>(dk, (int)dkv_st, dk_acc, key0, n_k, scale, scale);
    frag_store<T, D>(dv, (int)dkv_st, dv_acc, key0, n_k, 1.0f, 1.0f);
}

// The fused backward's last step: dq = scale * acc, acc fp32 [B·H, n_qt, BQ·D], each tile fragment-major:
// float4 f of thread t (its dqt[mb][j], f = mb · BQ/8 + j) at f · 128 + t; dq in the caller's layout.
template <typename T, int D>
__global__ void __launch_bounds__(256) attention_bwd_dq_store(const float* __restrict__ acc, T* __restrict__ dq,
                                                              long long n, int n_q, int n_h, float scale,
                                                              KILN_LAYOUT(dq)) {
    constexpr int BQ = TcShape<D>::fused_q;
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    const float4 x = *reinterpret_cast<const float4*>(acc + i);
    const long long tile = i / (BQ * D);
    const int n_qt = (n_q + BQ - 1) / BQ, bh = (int)(tile / n_qt), qt = (int)(tile % n_qt);
    const int r = (int)(i % (BQ * D)) / 4, f = r / kAttnThreads, t = r % kAttnThreads;
    const int mb = f / (BQ / 8), j = f % (BQ / 8), lane = t & 31;
    const int d = mb * 64 + (t >> 5) * 16 + (lane >> 2), query = qt * BQ + j * 8 + 2 * (lane & 3);
    T* p = dq + (head_offset(bh, n_h, dq_sb, dq_sh) + (long long)query * dq_st + d);
    if (query < n_q) {
        p[0] = from_float<T>(x.x * scale);
        p[8] = from_float<T>(x.z * scale);
    }
    if (query + 1 < n_q) {
        p[dq_st] = from_float<T>(x.y * scale);
        p[dq_st + 8] = from_float<T>(x.w * scale);
    }
}

// ---- Forward with flash-attention 3's structure (Shah et al. 2024): TMA, mbarriers, warp specialisation
//
// A persistent kernel: one block per SM takes jobs (128 query rows of one head, TmaJob's order) as it
// frees up: its first is its index, each next one from a ticket counter (atomicAdd by the producer, the
// job passed to the consumers in shared memory beside Q's barrier), so that a job's first loads overlap
// the last one's products and output (a block of this size is alone on its SM: its start-up is not
// hidden by another block's work) and the blocks finish together. 384 threads = three warpgroups.
// Warpgroup 0 is the producer: it gives up registers (setmaxnreg.dec to kTmaProducerRegs) and one
// thread issues the TMA loads (cp.async.bulk.tensor, tensor maps built on the host with
// cuTensorMapEncodeTiled, passed as __grid_constant__ kernel parameters): per job Q's 128 rows (once q_empty says both consumers hold the last job's Q in
// registers), then K and V tiles of BN = 128 keys into a ring of STAGES shared-memory stages, the
// ring's position carried from job to job. Warpgroups 1 and 2 are the consumers (setmaxnreg.inc to
// kTmaConsumerRegs), 64 query rows each, Q's A fragments read once from shared memory. Iteration
// it issues S(it) = Q·K(it)ᵀ and then O += P(it - 1)·V(it - 1) (wgmma), waits for S only, runs the
// online softmax of S(it) while the P·V product runs, then waits for it, frees stage it - 1,
// rescales O and packs P(it) (flash-attention 3's overlap inside a warpgroup).
// PingPong: the two consumers take turns at issuing their products (named barriers 1 and 2, the
// turn passed on as soon as the products are issued), so that one's softmax runs while the
// other's products do (flash-attention 3's ping-pong); without it the warp schedulers interleave
// the two freely.
// Synchronisation is by mbarriers with phase bits: full[s] completes when the producer's
// arrive.expect_tx and the TMA bytes of stage s have landed (the block's K/V tile kv, counted over
// its jobs, uses stage kv % STAGES, phase (kv / STAGES) & 1); empty[s] completes when all 256 consumer threads have arrived after their
// products on stage s are done, and the producer waits on it before refilling the stage. TMA writes
// each 64-column block of a tile with the 128-byte swizzle, which is SwTile's layout, so the wgmma
// descriptors are the other kernels'. Rows past n_q or n_k arrive as zeros (TMA's out-of-bounds
// fill) and are masked as in attention_fwd_tc. Dynamic shared memory: the launcher's
// tma_shared_bytes (TmaFwdShape's tiles and barriers, and 1024 bytes to align them).

constexpr int kTmaThreads = KILN_ATTN_TMA_THREADS;      // producer warpgroup + 2 consumer warpgroups
constexpr int kTmaRows = KILN_ATTN_TMA_ROWS;            // query rows per block (2 x 64)
constexpr int kTmaKeys = KILN_ATTN_TMA_KEYS;            // keys per K/V tile
// setmaxnreg's split (multiples of 8 in 24..256, executed by every warp of a warpgroup): the
// consumers' increase waits until the block's pool (its launch registers x 384) holds it.
constexpr int kTmaProducerRegs = KILN_ATTN_TMA_PRODUCER_REGS;
constexpr int kTmaConsumerRegs = KILN_ATTN_TMA_CONSUMER_REGS;
static_assert(kTmaProducerRegs % 8 == 0 && kTmaConsumerRegs % 8 == 0 && kTmaProducerRegs >= 24 &&
                  kTmaConsumerRegs <= 256 && 128 * kTmaProducerRegs + (kTmaThreads - 128) * kTmaConsumerRegs <= 65536,
              "setmaxnreg takes multiples of 8 in 24..256, within the SM's 64K registers");
constexpr int kTmaTurnBarrier = 1;     // named barriers 1 and 2: consumer 0's and 1's turn (ping-pong)
constexpr int kTmaConsumerBarrier = 3;  // named barriers 3 and 4: consumer 0's and 1's 128 threads (dK/dV at D 128)

template <int D> struct TmaFwdShape {
    static constexpr int STAGES = D >= 128 ? KILN_ATTN_TMA_STAGES_D128 : KILN_ATTN_TMA_STAGES;
    static constexpr int Q_BYTES = SwTile<kTmaRows, D>::BYTES;
    static constexpr int KV_BYTES = SwTile<kTmaKeys, D>::BYTES;
    // Q, then per stage K and V, then the mbarriers (q_full, q_empty, full[STAGES], empty[STAGES]), then
    // the job the producer took (an int).
    static constexpr int BAR_OFFSET = Q_BYTES + 2 * STAGES * KV_BYTES;
    static constexpr int JOB_OFFSET = BAR_OFFSET + 8 * (2 + 2 * STAGES);
};

// A CUtensorMap: 128 opaque bytes, 64-byte aligned, passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
    u64 v[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier is in phase 0: waiting
// for parity 1, the phase before it, returns at once).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// Whether the phase of parity `parity` has completed, without waiting.
__device__ __forceinline__ bool mbar_ready(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done;
}

// Named barriers of the 256 consumer threads (barrier 0 is __syncthreads'): sync waits for the
// other consumer's arrival, arrive does not wait.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// TMA: the box at (c0 columns, c1 rows, c2 head, c3 batch) of the tensor map into shared memory
// at dst, completing `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap& map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 ::"r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}

// Rows [r0, r0 + R) of a [n, D] operand (its tensor map) into the SwTile at dst: one TMA box of 64
// columns (128 bytes, the swizzle's width) per column block.
template <int R, int D>
__device__ __forceinline__ void tma_tile(u32 dst, const TmaMap& map, int r0, int h, int b, u32 bar) {
    using Tile = SwTile<R, D>;
#pragma unroll
    for (int cb = 0; cb < D / Tile::CW; ++cb) tma_load_4d(dst + cb * R * Tile::SW, map, cb * Tile::CW, r0, h, b, bar);
}

// The A fragments of rows [row0, row0 + 16) of the SwTile at shared address tile (16-bit elements).
template <int R, int D>
__device__ __forceinline__ void frag_load_a_smem(u32 (&a)[D / 16][4], u32 tile, int row0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r_lo = row0 + g, r_hi = r_lo + 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int ch = kk * 2, in = 4 * c;  // chunk of columns kk*16.., byte offset of column 2c in it
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a[kk][0]) : "r"(tile + SwTile<R, D>::chunk(r_lo, ch) + in));
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a[kk][1]) : "r"(tile + SwTile<R, D>::chunk(r_hi, ch) + in));
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a[kk][2]) : "r"(tile + SwTile<R, D>::chunk(r_lo, ch + 1) + in));
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a[kk][3]) : "r"(tile + SwTile<R, D>::chunk(r_hi, ch + 1) + in));
    }
}

// One job of a persistent block: query rows [m0, m0 + kTmaRows) of head bh (= b * n_h + h) against
// its n_tiles key tiles of BN keys (the forward's kTmaKeys, the dQ kernel's streamed rows); job w in
// GroupedJob's order (rank 0: the last rows, which see the most keys).
template <int BN> struct TmaJob {
    int bh, b, h, m0, n_tiles;
    __device__ __forceinline__ TmaJob(int w, int n_bh, int n_mb, int group, int n_h, int n_q, int n_k, int off) {
        const GroupedJob jb(w, n_bh, n_mb, group);
        bh = jb.bh;
        b = bh / n_h;
        h = bh % n_h;
        m0 = (n_mb - 1 - jb.rank) * kTmaRows;
        const int k_end = min(n_k, min(m0 + kTmaRows, n_q) - 1 + off + 1);  // keys some row of the job sees
        n_tiles = (k_end - 1) / BN + 1;
    }
};

// The max and the sum of t[I, I + N) as balanced trees (N a power of 2).
template <int N, int I = 0> struct Tree {
    template <int M> static __device__ __forceinline__ float max(const float (&t)[M]) {
        return fmaxf(Tree<N / 2, I>::max(t), Tree<N / 2, I + N / 2>::max(t));
    }
    template <int M> static __device__ __forceinline__ float sum(const float (&t)[M]) {
        return Tree<N / 2, I>::sum(t) + Tree<N / 2, I + N / 2>::sum(t);
    }
};
template <int I> struct Tree<1, I> {
    template <int M> static __device__ __forceinline__ float max(const float (&t)[M]) { return t[I]; }
    template <int M> static __device__ __forceinline__ float sum(const float (&t)[M]) { return t[I]; }
};

// The online softmax of one tile of scores sc (keys n0.., this thread's rows r_lo and r_hi of the
// warp's rows row0..row0 + 15), in place: sc becomes the unnormalised probabilities, m and l the
// running row max (log2 units) and this lane's part of the row sum, a the factor O is rescaled by.
template <int BN>
__device__ __forceinline__ void tma_softmax_tile(float (&sc)[BN / 8][4], int n0, int row0, int r_lo, int r_hi, int c,
                                                 int off, int n_k, float sl2, float& m_lo, float& m_hi, float& l_lo,
                                                 float& l_hi, float& a_lo, float& a_hi) {
    const bool edge = n0 + BN - 1 > row0 + off || n0 + BN > n_k;  // some key hidden from some row of the warp
    // Maxima and sums as balanced trees over the tile's BN / 8 column groups, not one chain: log2(BN / 4)
    // dependent steps instead of BN / 8 (the warp has few independent instructions to hide a chain's latency).
    float t_lo[BN / 8], t_hi[BN / 8];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = n0 + j * 8 + 2 * c + (e & 1);
            const int row = e < 2 ? r_lo : r_hi;
            if (edge && (key > row + off || key >= n_k)) sc[j][e] = -KILN_INF;
        }
        t_lo[j] = fmaxf(sc[j][0], sc[j][1]);
        t_hi[j] = fmaxf(sc[j][2], sc[j][3]);
    }
    float mx_lo = Tree<BN / 8>::max(t_lo), mx_hi = Tree<BN / 8>::max(t_hi);
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o_));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o_));
    }
    // The max of the raw scores, then in log2 units (sl2 > 0 keeps the order, so it is the max of the scaled ones)
    const float mn_lo = fmaxf(m_lo, mx_lo * sl2), mn_hi = fmaxf(m_hi, mx_hi * sl2);
    // A row with every key masked so far keeps m = -inf; its exponentials are then all 0.
    const float sub_lo = mn_lo == -KILN_INF ? 0.0f : mn_lo, sub_hi = mn_hi == -KILN_INF ? 0.0f : mn_hi;
    a_lo = ex2(m_lo - sub_lo);
    a_hi = ex2(m_hi - sub_hi);
    m_lo = mn_lo;
    m_hi = mn_hi;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        sc[j][0] = ex2(fmaf(sc[j][0], sl2, -sub_lo));  // one FFMA: scaled and shifted
        sc[j][1] = ex2(fmaf(sc[j][1], sl2, -sub_lo));
        sc[j][2] = ex2(fmaf(sc[j][2], sl2, -sub_hi));
        sc[j][3] = ex2(fmaf(sc[j][3], sl2, -sub_hi));
        t_lo[j] = sc[j][0] + sc[j][1];
        t_hi[j] = sc[j][2] + sc[j][3];
    }
    l_lo = l_lo * a_lo + Tree<BN / 8>::sum(t_lo);  // the quad's parts are summed at the end
    l_hi = l_hi * a_hi + Tree<BN / 8>::sum(t_hi);
}

template <typename T, int D, bool PingPong>
__global__ void __launch_bounds__(kTmaThreads, 1)
    attention_fwd_tma(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
                      const __grid_constant__ TmaMap v_map, T* __restrict__ out, float* __restrict__ lse,
                      int* __restrict__ ticket, int n_q, int n_k, int off, int n_h, int n_bh, int group, float scale,
                      KILN_LAYOUT(o)) {
    constexpr int BN = kTmaKeys;
    using Shape = TmaFwdShape<D>;
    constexpr int S = Shape::STAGES;
    extern __shared__ unsigned char dsmem[];
    const u32 base = align1024(dsmem);
    const u32 qs = base, ks = base + Shape::Q_BYTES, vs = ks + S * Shape::KV_BYTES;
    const u32 q_full = base + Shape::BAR_OFFSET, q_empty = q_full + 8, full = q_empty + 8, empty = full + 8 * S;
    const u32 job_slot = base + Shape::JOB_OFFSET;
    const int n_mb = (n_q + kTmaRows - 1) / kTmaRows, n_work = n_mb * n_bh;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, kTmaThreads - 128);
        for (int s = 0; s < S; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, kTmaThreads - 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {  // the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kTmaProducerRegs));
        if (threadIdx.x != 0) return;
        int kv = 0;  // K/V tiles loaded so far by this block: tile kv goes to stage kv % S, round kv / S
        for (int job = 0;; ++job) {
            // the block's first job is its index (the grid is at most n_work blocks), the next ones from the ticket
            const int w = job == 0 ? blockIdx.x : gridDim.x + atomicAdd(ticket, 1);
            mbar_wait(q_empty, (job & 1) ^ 1);  // both consumers hold the last job's Q in registers (and read its w)
            // w for the consumers: the arrive on q_full below releases it, their wait on q_full acquires it
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(job_slot), "r"(w) : "memory");
            if (w >= n_work) {  // no jobs left: the consumers see w and stop
                mbar_arrive(q_full);
                return;
            }
            const TmaJob<BN> jb(w, n_bh, n_mb, group, n_h, n_q, n_k, off);
            mbar_expect_tx(q_full, Shape::Q_BYTES);
            tma_tile<kTmaRows, D>(qs, q_map, jb.m0, jb.h, jb.b, q_full);
            for (int it = 0; it < jb.n_tiles; ++it, ++kv) {
                const int s = kv % S;
                mbar_wait(empty + 8 * s, ((kv / S) & 1) ^ 1);  // the consumers are done with tile kv - S
                mbar_expect_tx(full + 8 * s, 2 * Shape::KV_BYTES);
                tma_tile<BN, D>(ks + s * Shape::KV_BYTES, k_map, it * BN, jb.h, jb.b, full + 8 * s);
                tma_tile<BN, D>(vs + s * Shape::KV_BYTES, v_map, it * BN, jb.h, jb.b, full + 8 * s);
            }
        }
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kTmaConsumerRegs));
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) - 4, g = lane >> 2, c = lane & 3;
    const float sl2 = scale * kLog2e;
    const int me = wg - 1;  // consumer 0 (rows 0-63 of a job) or 1 (rows 64-127)
    if (PingPong && me == 1) named_arrive(kTmaTurnBarrier, 256);  // consumer 0 takes the first turn
    int kv = 0;  // K/V tiles consumed so far, in the producer's order
    for (int job = 0;; ++job) {
        mbar_wait(q_full, job & 1);
        int w;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w) : "r"(job_slot) : "memory");
        if (w >= n_work) break;
        const TmaJob<BN> jb(w, n_bh, n_mb, group, n_h, n_q, n_k, off);
        const int row0 = jb.m0 + warp * 16, r_lo = row0 + g, r_hi = r_lo + 8;
        u32 qa[D / 16][4];
        frag_load_a_smem<kTmaRows, D>(qa, qs, warp * 16);
        // Q was read through the generic proxy and the producer's next TMA rewrites it through the async
        // one: the memory model asks for a proxy fence between them (the mbarrier alone orders the threads)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(q_empty);
        float o[D / 8][4];
        zero_acc(o);
        u32 pa[BN / 16][4];  // P(it - 1), the A operand of the product issued with S(it)
        float m_lo = -KILN_INF, m_hi = -KILN_INF, l_lo = 0.0f, l_hi = 0.0f, a_lo, a_hi;
        // Every wgmma below is issued unconditionally between its waits, so that ptxas can see which
        // product a wait completes (a conditional issue made it serialise them: C7514).
        {
            float sc[BN / 8][4];  // S = Q·Kᵀ overwrites it
            mbar_wait(full + 8 * (kv % S), (kv / S) & 1);
            if (PingPong) named_sync(kTmaTurnBarrier + me, 256);  // this consumer's turn at the tensor cores
            wg_issue<T, BN, D, BN, D, 0, true>(sc, qa, ks + (kv % S) * Shape::KV_BYTES);
            if (PingPong) named_arrive(kTmaTurnBarrier + (me ^ 1), 256);
            wg_wait<0>();
            fence_regs(sc);
            tma_softmax_tile<BN>(sc, 0, row0, r_lo, r_hi, c, off, n_k, sl2, m_lo, m_hi, l_lo, l_hi, a_lo, a_hi);
            c_to_a<T, BN>(pa, sc);
        }
        for (int it = 1; it < jb.n_tiles; ++it) {
            const int st = (kv + it) % S, prev = (kv + it - 1) % S;
            float sc[BN / 8][4];
            mbar_wait(full + 8 * st, ((kv + it) / S) & 1);
            if (PingPong) named_sync(kTmaTurnBarrier + me, 256);
            wg_issue<T, BN, D, BN, D, 0, true>(sc, qa, ks + st * Shape::KV_BYTES);
            wg_issue<T, D, BN, BN, D, 1>(o, pa, vs + prev * Shape::KV_BYTES);
            if (PingPong) named_arrive(kTmaTurnBarrier + (me ^ 1), 256);
            wg_wait<1>();  // S(it) is done; P(it - 1)·V(it - 1) may still run
            fence_regs(sc);
            tma_softmax_tile<BN>(sc, it * BN, row0, r_lo, r_hi, c, off, n_k, sl2, m_lo, m_hi, l_lo, l_hi, a_lo,
                                 a_hi);
            wg_wait<0>();  // P(it - 1)·V(it - 1) is in o, and its stage is free
            fence_regs(o);
            mbar_arrive(empty + 8 * prev);
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                o[j][0] *= a_lo;
                o[j][1] *= a_lo;
                o[j][2] *= a_hi;
                o[j][3] *= a_hi;
            }
            c_to_a<T, BN>(pa, sc);
        }
        const int last = (kv + jb.n_tiles - 1) % S;
        if (PingPong) named_sync(kTmaTurnBarrier + me, 256);
        wg_issue<T, D, BN, BN, D, 1>(o, pa, vs + last * Shape::KV_BYTES);
        if (PingPong) named_arrive(kTmaTurnBarrier + (me ^ 1), 256);
        wg_wait<0>();
        fence_regs(o);
        mbar_arrive(empty + 8 * last);
        kv += jb.n_tiles;
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o_);
            l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o_);
        }
        frag_store<T, D, true>(out + head_offset(jb.bh, n_h, o_sb, o_sh), (int)o_st, o, row0, n_q, 1.0f / l_lo,
                               1.0f / l_hi);
        if (c == 0) {
            const long long lb = (long long)jb.bh * n_q;
            if (r_lo < n_q) lse[lb + r_lo] = (m_lo + log2f(l_lo)) * kLn2;
            if (r_hi < n_q) lse[lb + r_hi] = (m_hi + log2f(l_hi)) * kLn2;
        }
    }
    if (PingPong && me == 0) named_sync(kTmaTurnBarrier, 256);  // consumer 1's last turn passed on: none left
}

// ---- The split backward with TMA and warp specialisation (KILN_ATTENTION_BWD=split-tma) ----------------
//
// attention_bwd_dkdv_tc's and attention_bwd_dq_tc's products for 128 rows a block instead of 64, in the TMA
// forward's structure: warpgroup 0 is the producer (its thread 0 issues the TMA loads of each streamed tile
// pair into a ring of STAGES stages: Q and dO for dK/dV, K and V for dQ), warpgroups 1 and 2 are the consumers,
// 64 rows each (their own operands in registers, read once; at D = 128 the dK/dV consumers' K and V in shared
// memory instead), sharing every stage: a tile crosses from L2 into
// shared memory once for 128 rows, where the one-warpgroup kernels move it once for 64, and no consumer thread
// spends instructions or a barrier on copies. A stage is empty when the 256 consumer threads have arrived,
// their products on it waited for; a consumer whose rows the tile is hidden from (causal) skips its products
// and only arrives. At 384 threads and ~68 KiB a block is alone on its SM, so the kernels are persistent, as the
// forward: a grid of at most one block an SM, each taking jobs of 128 rows (GroupedJob's order, rank 0 the
// longest rows) from a ticket (bwd_take_job); one job a block took 1.13-1.20x their time at T <= 1024 (H100).
template <int D> struct TmaBwdShape {
    static constexpr int ROWS = KILN_ATTN_BWD_TMA_ROWS;  // rows of a streamed tile
    static constexpr int STAGES = KILN_ATTN_BWD_TMA_STAGES;
    static constexpr int TILE_BYTES = SwTile<ROWS, D>::BYTES;
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // Q and dO, or K and V
    // The stages, then (dK/dV at D >= 128, KV_SMEM) the two consumers' K and V tiles (SwTile<kTcRows, D> each)
    // or (D < 128, ROWS_SMEM) the job's own rows' tiles (SwTile<kTmaRows, D>: Q, dO and O for dQ, K and V for
    // dK/dV), then (dK/dV) the lse and delta of each stage ([STAGES][2][ROWS] floats), then the mbarriers
    // (full[STAGES], empty[STAGES], job_full, job_empty, rows_full, rows_empty), then the job the producer took
    // (an int); the launcher's bwd_tma_shared_bytes adds 1024 for the alignment.
    static constexpr bool KV_SMEM = D >= 128;
    static constexpr int KV_TILE_BYTES = SwTile<kTcRows, D>::BYTES;
    // The job's own rows by TMA, loaded by the producer while the consumers finish the job before: the
    // consumers' fragments then come from shared memory at a job's start, not from global memory (each job's
    // first products waited on those loads). Where they fit: at D = 128 the stages and K/V tiles fill it.
    static constexpr bool ROWS_SMEM = !KV_SMEM;
    static constexpr int ROWS_TILE_BYTES = SwTile<kTmaRows, D>::BYTES;
    static constexpr int KV_OFFSET = STAGES * STAGE_BYTES;  // the consumers' K/V tiles, or the job's rows
    static constexpr int VEC_OFFSET = KV_OFFSET + (KV_SMEM ? 2 * 2 * KV_TILE_BYTES : 3 * ROWS_TILE_BYTES);
    static constexpr int BAR_OFFSET = VEC_OFFSET + STAGES * 2 * ROWS * 4;
    static constexpr int JOB_OFFSET = BAR_OFFSET + 8 * (2 * STAGES + 4);
    // The fused dK/dV/dQ kernel (FusedDq) only, after the job slot, 1024-aligned: each consumer's dSᵀ tile
    // (SwTile<ROWS, kTcRows>), DQ_STAGES stages of a tile's fp32 dQ (ROWS x D, fragment-major), their mbarriers
    // (dq_half, dq_full, dq_empty, DQ_STAGES each) and each stage's tile (two ints: the tile's index in the
    // accumulator and its place in line, or -1: no more tiles); the launcher's fused_tma_shared_bytes.
    static constexpr int DQ_STAGES = 3;
    static constexpr int DS_OFFSET = (JOB_OFFSET + 8 + 1023) / 1024 * 1024;
    static constexpr int DS_BYTES = SwTile<ROWS, kTcRows>::BYTES;
    static constexpr int DQ_STAGE_BYTES = ROWS * D * 4;
    static constexpr int DQ_OFFSET = DS_OFFSET + 2 * DS_BYTES;
    static constexpr int DQ_BAR_OFFSET = DQ_OFFSET + DQ_STAGES * DQ_STAGE_BYTES;
    static constexpr int DQ_TILE_OFFSET = DQ_BAR_OFFSET + 3 * 8 * DQ_STAGES;
};

// key_rows_issue's A operand: K's (V's) fragments in registers, or its tile's shared address.
template <bool Smem, int D> struct KeyRowsOf {
    using type = u32[D / 16][4];
};
template <int D> struct KeyRowsOf<true, D> {
    using type = u32;
};

// Rows [r0, r0 + R) of an operand (its tensor map, boxes of BR rows) into the SwTile<R, D> at dst: R / BR boxes
// per 64-column block, completing bar's transaction bytes.
template <int R, int BR, int D>
__device__ __forceinline__ void tma_rows(u32 dst, const TmaMap& map, int r0, int h, int b, u32 bar) {
    using Tile = SwTile<R, D>;
#pragma unroll
    for (int cb = 0; cb < D / Tile::CW; ++cb)
#pragma unroll
        for (int i = 0; i < R / BR; ++i)
            tma_load_4d(dst + cb * R * Tile::SW + i * BR * Tile::SW, map, cb * Tile::CW, r0 + i * BR, h, b, bar);
}

// One job of a persistent dK/dV block: keys [n0, n0 + kTmaRows) of head bh (= b * n_h + h) against the n_tiles
// query tiles of BQ rows from q_begin that see some of them; job w in GroupedJob's order (rank 0: the first keys,
// which the most queries see).
// Descending (the fused kernel): rank 0 is the last key block, so that a head's key blocks are handed out in the
// order their dQ contributions are added (attention_bwd_dkdv_tma's FusedDq).
template <int BQ, bool Descending = false> struct TmaKeyJob {
    int bh, b, h, n0, q_begin, n_tiles;
    __device__ __forceinline__ TmaKeyJob(int w, int n_bh, int n_kb, int group, int n_h, int n_q, int off) {
        const GroupedJob jb(w, n_bh, n_kb, group);
        bh = jb.bh;
        b = bh / n_h;
        h = bh % n_h;
        n0 = (Descending ? n_kb - 1 - jb.rank : jb.rank) * kTmaRows;
        q_begin = (max(n0 - off, 0) / BQ) * BQ;  // the first query tile that sees key n0
        n_tiles = q_begin < n_q ? (n_q - q_begin + BQ - 1) / BQ : 0;
    }
};
static_assert(kTmaRows == 2 * kTcRows, "the split-tma kernels' jobs are two consumer warpgroups' rows");

// The persistent backward blocks' job hand-over: the producer's thread 0 takes job number w (the block's
// index first, then from the ticket), waits until every reader of the last one has it (job_empty), writes w
// to the slot and arrives on job_full; a reader waits on job_full, reads w and arrives on job_empty. w >= n_work:
// no jobs left.
__device__ __forceinline__ int bwd_take_job(int job, int* ticket, u32 job_full, u32 job_empty, u32 job_slot) {
    const int w = job == 0 ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(ticket, 1);
    mbar_wait(job_empty, (job & 1) ^ 1);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(job_slot), "r"(w) : "memory");
    mbar_arrive(job_full);  // releases the store above to the readers' wait
    return w;
}
__device__ __forceinline__ int bwd_read_job(int job, u32 job_full, u32 job_empty, u32 job_slot) {
    mbar_wait(job_full, job & 1);
    int w;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w) : "r"(job_slot) : "memory");
    mbar_arrive(job_empty);
    return w;
}

// A consumer's part of tile t's dQ (dqt, this warpgroup's fragments) into stage t % NS: consumer 1 (wg 1)
// waits until the writer has read tile t - NS from it, writes its part and names the tile (its index in the
// accumulator and its place in line), consumer 2 adds its own part once consumer 1's is there; the stage is
// then full for dq_writer. Store false: only the tile's name (place -1 ends the writer).
template <int BQ, int D, int NS, bool Store = true>
__device__ __forceinline__ void dq_stage_tile(const float (&dqt)[1][BQ / 8][4], int wg, int t, int tile, int place,
                                              u32 dq_stage, u32 dq_half, u32 dq_full, u32 dq_empty, int* tiles) {
    const int st = t % NS, round = (t / NS) & 1;
    const u32 stage = dq_stage + st * BQ * D * 4;
    if (wg == 1) {
        mbar_wait(dq_empty + 8 * st, round ^ 1);
        if constexpr (Store) stage_dq<BQ, D>(stage, dqt, (int)threadIdx.x - 128);
        if (threadIdx.x == 128) {
            tiles[2 * st] = tile;
            tiles[2 * st + 1] = place;
        }
        mbar_arrive(dq_half + 8 * st);
    } else {
        mbar_wait(dq_half + 8 * st, round);
        if constexpr (Store) stage_dq<BQ, D, true>(stage, dqt, (int)threadIdx.x - 256);
        mbar_arrive(dq_full + 8 * st);
    }
}

// The fused backward's dQ writer (one thread of the producer warpgroup): takes the consumers' staged tiles in
// their order (stage t % NS, its round t / NS; the stage's tile index and place in line beside it, written by
// consumer 1; place -1: no more) and adds each into the accumulator in the tile's order: key blocks descending,
// from the last that sees the tile (which stores) down to key block 0. It waits until the tile's counter equals
// its place in that order (acquire), copies the stage (one bulk store or reduce-add), frees the stage once the
// copy has read it, and raises the counter (release) once the copy has completed: the next key block in line then
// adds onto a complete sum, so every element's additions come in one order on every run. The completion of a
// tile's copy is waited for after the next tile's copy is issued (two in flight), or before the writer waits for
// a counter or a stage (a tile of its own block may be the one before in line; nothing is held while it waits).
template <int D, int BQ, int NS>
__device__ __forceinline__ void dq_writer(float* dq_acc, int* dq_sem, u32 dq_stage, u32 dq_full, u32 dq_empty,
                                          const int* tiles) {
    constexpr u32 BYTES = BQ * D * 4;
    int* pending = nullptr;  // the counter of the tile whose copy is in flight
    auto settle = [&](bool all) {  // raise the counter of the tile in flight once its copy has completed
        if (all)
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        else
            asm volatile("cp.async.bulk.wait_group 1;\n" ::: "memory");
        asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the copy's writes before the release
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(pending) : "memory");
        pending = nullptr;
    };
    for (int t = 0;; ++t) {
        const int st = t % NS;
        const u32 stage = dq_stage + st * BYTES;
        if (pending && !mbar_ready(dq_full + 8 * st, (t / NS) & 1)) settle(true);
        mbar_wait(dq_full + 8 * st, (t / NS) & 1);
        const int tile = tiles[2 * st], place = tiles[2 * st + 1];
        if (place < 0) break;
        int* const sem = dq_sem + tile;
        float* const dst = dq_acc + (long long)tile * BQ * D;
        int seen;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
        if (seen != place) {
            if (pending) settle(true);
            do {
                asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
            } while (seen != place);
        }
        asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the acquire before the copy's async reads
        if (place == 0)
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                         ::"l"(dst), "r"(stage), "n"(BYTES) : "memory");
        else
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                         ::"l"(dst), "r"(stage), "n"(BYTES) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // the stage has been read
        mbar_arrive(dq_empty + 8 * st);
        if (pending) settle(false);
        pending = sem;
    }
    if (pending) settle(true);
}

// dK and dV for 128 keys a job: the producer's warp 1 copies each query tile's lse (in log2 units) and delta
// into the stage beside its Q and dO, so a stage is full when the TMA bytes have landed and warp 1's 32 lanes
// have arrived. A persistent kernel, as the forward (one block an SM, jobs from a ticket, bwd_take_job): the
// jobs' tiles go through the ring in order (tile kv counted over the block's jobs), so the producer loads the
// next job's first tiles while the consumers store this job's dK and dV and load its K and V. At D = 128 the
// consumers' registers hold dK and dV but not also K and V (that spilled 268 bytes): each consumer copies its 64
// rows of K and V into its own tiles once a job, and Sᵀ and dPᵀ read them from there (key_rows_issue).
//
// FusedDq (KILN_ATTENTION_BWD=fused-tma, head dim 64): the same kernel also forms each
// tile's dQ, deterministically. Each consumer stores its dSᵀ (64 keys x BQ queries) transposed to its own tile
// and computes dQᵀ = Kᵀ·dSᵀ over its 64 keys (K from the job's rows tile, which therefore stays until the job's
// end); consumer 1 writes its dQ to a stage, consumer 2 adds its own (a fixed order), and the producer's warp 2
// adds the stage into the fp32 accumulator dq_acc [B·H, n_qt, BQ·D] (fragment-major, attention_bwd_dq_store's
// layout) with one bulk copy, after the key blocks before it in line: a tile's contributions go in descending
// key-block order (the last key block that sees the tile stores, the others reduce-add), each waiting for the
// tile's counter dq_sem[bh · n_qt + qt] (zeroed by the launcher) to reach its place, then raising it once its
// copy has completed. The jobs are handed out in that order too (TmaKeyJob's Descending), so a block reaches a
// tile two tiles' products after the one before it in line and, in lockstep, never waits: modelled at 0.71-0.80x
// the split's time (benchmarks/attention_fused_schedule.py); a block only ever waits on jobs handed out before
// its own, which are running or done (one block an SM, all resident). Bitwise repeatable. Measured on an H100
// (2026-12-07): 0.875-0.94x split-tma's time at T 2048-16384, 1.0-1.07x at T <= 1024; without the order it takes
// the same time: the writer's 16 KiB reduce-adds, ~1.8 us each, bound it (benchmarks/results/attention/NOTES.md).
template <typename T, int D, bool FusedDq = false>
__global__ void __launch_bounds__(kTmaThreads, 1)
    attention_bwd_dkdv_tma(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap g_map,
                           const __grid_constant__ TmaMap k_map, const __grid_constant__ TmaMap v_map,
                           const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                           const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                           int* __restrict__ ticket, int n_q, int n_k, int off, int n_h, int n_bh, float scale,
                           KILN_LAYOUT(kv), KILN_LAYOUT(dkv), int group, float* __restrict__ dq_acc,
                           int* __restrict__ dq_sem) {
    using Shape = TmaBwdShape<D>;
    using Job = TmaKeyJob<Shape::ROWS, FusedDq>;
    static_assert(!FusedDq || (Shape::ROWS_SMEM && D == 64), "the fused dQ reads K from the job's rows tile (D 64)");
    constexpr int BQ = Shape::ROWS, S = Shape::STAGES;
    extern __shared__ unsigned char dsmem[];
    const u32 base = align1024(dsmem);
    // FusedDq: each consumer's dSᵀ tile, the dQ stages, their barriers (stage s at + 8 s) and tiles
    constexpr int NS = Shape::DQ_STAGES;
    const u32 ds_tiles = base + Shape::DS_OFFSET, dq_stage = base + Shape::DQ_OFFSET;
    const u32 dq_half = base + Shape::DQ_BAR_OFFSET, dq_full = dq_half + 8 * NS, dq_empty = dq_full + 8 * NS;
    int* const dq_tiles = reinterpret_cast<int*>(dsmem + (base - smem_addr(dsmem)) + Shape::DQ_TILE_OFFSET);
    const u32 full = base + Shape::BAR_OFFSET, empty = full + 8 * S, job_full = empty + 8 * S, job_empty = job_full + 8;
    const u32 rows_full = job_empty + 8, rows_empty = rows_full + 8, rows = base + Shape::KV_OFFSET;
    const u32 job_slot = base + Shape::JOB_OFFSET;
    float* const vec = reinterpret_cast<float*>(dsmem + (base - smem_addr(dsmem)) + Shape::VEC_OFFSET);
    const int n_kb = (n_k + kTmaRows - 1) / kTmaRows, n_work = n_kb * n_bh;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full + 8 * s, 1 + 32);  // thread 0's arrive with the TMA bytes, warp 1's 32 lanes
            mbar_init(empty + 8 * s, kTmaThreads - 128);
        }
        mbar_init(job_full, 1);
        mbar_init(job_empty, kTmaThreads - 128 + 32);  // the consumers and the producer's warp 1
        mbar_init(rows_full, 1);
        mbar_init(rows_empty, kTmaThreads - 128);
        if constexpr (FusedDq) {
            for (int s = 0; s < NS; ++s) {
                mbar_init(dq_half + 8 * s, 128);  // consumer 1 has written stage s
                mbar_init(dq_full + 8 * s, 128);  // consumer 2 has added its part: the stage holds the tile's dQ
                mbar_init(dq_empty + 8 * s, 1);   // the writer's copy has read it
            }
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {  // the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kTmaProducerRegs));
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        if constexpr (FusedDq) {
            if (threadIdx.x == 64) {  // warp 2's lane 0: the dQ writer
                dq_writer<D, BQ, NS>(dq_acc, dq_sem, dq_stage, dq_full, dq_empty, dq_tiles);
                return;
            }
        }
        if (threadIdx.x != 0 && warp != 1) return;
        int kv = 0;  // query tiles this block has taken: tile kv goes to stage kv % S, round kv / S
        for (int job = 0;; ++job) {
            const int w = threadIdx.x == 0 ? bwd_take_job(job, ticket, job_full, job_empty, job_slot)
                                           : bwd_read_job(job, job_full, job_empty, job_slot);
            if (w >= n_work) return;
            const Job jb(w, n_bh, n_kb, group, n_h, n_q, off);
            if (threadIdx.x == 0) {
                if constexpr (Shape::ROWS_SMEM) {  // the job's keys: K and V, once the consumers hold the last job's
                    mbar_wait(rows_empty, (job & 1) ^ 1);
                    mbar_expect_tx(rows_full, 2 * Shape::ROWS_TILE_BYTES);
                    tma_rows<kTmaRows, BQ, D>(rows, k_map, jb.n0, jb.h, jb.b, rows_full);
                    tma_rows<kTmaRows, BQ, D>(rows + Shape::ROWS_TILE_BYTES, v_map, jb.n0, jb.h, jb.b, rows_full);
                }
                for (int it = 0; it < jb.n_tiles; ++it, ++kv) {
                    const int s = kv % S;
                    mbar_wait(empty + 8 * s, ((kv / S) & 1) ^ 1);  // the consumers are done with tile kv - S
                    mbar_expect_tx(full + 8 * s, Shape::STAGE_BYTES);
                    const u32 st = base + s * Shape::STAGE_BYTES;
                    tma_tile<BQ, D>(st, q_map, jb.q_begin + it * BQ, jb.h, jb.b, full + 8 * s);
                    tma_tile<BQ, D>(st + Shape::TILE_BYTES, g_map, jb.q_begin + it * BQ, jb.h, jb.b, full + 8 * s);
                }
            } else {
                const float* const l_row = lse + (long long)jb.bh * n_q;
                const float* const d_row = delta + (long long)jb.bh * n_q;
                for (int it = 0; it < jb.n_tiles; ++it, ++kv) {
                    const int s = kv % S;
                    mbar_wait(empty + 8 * s, ((kv / S) & 1) ^ 1);
                    float* const l = vec + s * 2 * BQ;
#pragma unroll
                    for (int i = lane; i < BQ; i += 32) {
                        const int query = jb.q_begin + it * BQ + i;
                        l[i] = query < n_q ? l_row[query] * kLog2e : 0.0f;
                        l[BQ + i] = query < n_q ? d_row[query] : 0.0f;
                    }
                    mbar_arrive(full + 8 * s);  // releases the stores above to the consumers' wait
                }
            }
        }
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kTmaConsumerRegs));
    const int warp = (threadIdx.x >> 5) - 4 * wg;
    const float sl2 = scale * kLog2e;
    int kv = 0;  // query tiles consumed so far, in the producer's order
    for (int job = 0;; ++job) {
        const int w = bwd_read_job(job, job_full, job_empty, job_slot);
        if (w >= n_work) break;
        const Job jb(w, n_bh, n_kb, group, n_h, n_q, off);
        const int key0 = jb.n0 + (wg - 1) * kTcRows + warp * 16;
        const long long kvbase = head_offset(jb.bh, n_h, kv_sb, kv_sh);
        typename KeyRowsOf<Shape::KV_SMEM, D>::type ka, va;
        if constexpr (Shape::KV_SMEM) {
            // The warpgroup's 64 rows of K and V into its tiles, once every warp is done with the last job's
            ka = base + Shape::KV_OFFSET + (wg - 1) * 2 * Shape::KV_TILE_BYTES;
            va = ka + Shape::KV_TILE_BYTES;
            named_sync(kTmaConsumerBarrier + wg - 1, 128);
            tile2_async<kTcRows, D>(ka, k + kvbase, va, v + kvbase, (int)kv_st, jb.n0 + (wg - 1) * kTcRows, n_k,
                                    (int)threadIdx.x - 128 * wg);
            cp_async_commit();
            cp_async_wait_all();
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // for wgmma's reads
            named_sync(kTmaConsumerBarrier + wg - 1, 128);
        } else {
            // this warp's rows of the job's K and V tiles (zeros past n_k: TMA's fill)
            const int r = key0 - jb.n0;
            mbar_wait(rows_full, job & 1);
            frag_load_a_smem<kTmaRows, D>(ka, rows, r);
            frag_load_a_smem<kTmaRows, D>(va, rows + Shape::ROWS_TILE_BYTES, r);
            // read through the generic proxy, rewritten by the producer's next TMA (the async proxy); FusedDq's
            // dQᵀ reads K from the tile until the job's end
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            if constexpr (!FusedDq) mbar_arrive(rows_empty);
        }
        float dk_acc[D / 8][4], dv_acc[D / 8][4];
        zero_acc(dk_acc);
        zero_acc(dv_acc);
        for (int it = 0; it < jb.n_tiles; ++it) {
            const int s = (kv + it) % S, q0 = jb.q_begin + it * BQ;
            const u32 qb = base + s * Shape::STAGE_BYTES, gb = qb + Shape::TILE_BYTES;
            const float* const l = vec + s * 2 * BQ;
            mbar_wait(full + 8 * s, ((kv + it) / S) & 1);
            const bool before = q0 + BQ - 1 + off < jb.n0 + (wg - 1) * kTcRows;  // every query of the tile before
            if constexpr (!FusedDq) {                                            // this warpgroup's keys
                if (before) {
                    mbar_arrive(empty + 8 * s);
                    continue;
                }
                dkdv_tile<T, BQ, D>(dk_acc, dv_acc, ka, va, qb, gb, l, l + BQ, 1.0f, q0, key0, n_q, off, sl2);
                mbar_arrive(empty + 8 * s);  // this thread's products on stage s are done
            } else {
                float dqt[1][BQ / 8][4];  // this warpgroup's part of the tile's dQᵀ (D = 64 rows x BQ)
                if (before) {
                    mbar_arrive(empty + 8 * s);
                    zero_acc(dqt[0]);
                } else {
                    const u32 ds = ds_tiles + (wg - 1) * Shape::DS_BYTES;
                    dkdv_tile<T, BQ, D, decltype(ka), true>(dk_acc, dv_acc, ka, va, qb, gb, l, l + BQ, 1.0f, q0, key0,
                                                            n_q, off, sl2, ds);
                    mbar_arrive(empty + 8 * s);
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // dSᵀ for wgmma's reads
                    named_sync(kTmaConsumerBarrier + wg - 1, 128);
                    // dQᵀ = Kᵀ·dSᵀ over this warpgroup's 64 keys: Kᵀ M-major from the job's K tile
                    wg_issue_ss<T, BQ, kTcRows, SwTile<kTmaRows, D>, SwTile<BQ, kTcRows>, 1, 0>(
                        dqt[0], rows + (wg - 1) * kTcRows * SwTile<kTmaRows, D>::SW, ds, 0);
                    wg_wait<0>();
                    fence_regs(dqt[0]);
                }
                // the tile's dQ into stage t % NS: consumer 1 writes it and names the tile, consumer 2 adds
                // its own (the stage's round t / NS); the tiles the key blocks that see tile qt are 0 .. last,
                // the last adds first
                const int t = kv + it, qt = q0 / BQ;
                const int place = min(n_kb - 1, (q0 + BQ - 1 + off) / kTmaRows) - jb.n0 / kTmaRows;
                dq_stage_tile<BQ, D, NS>(dqt, wg, t, jb.bh * ((n_q + BQ - 1) / BQ) + qt, place, dq_stage, dq_half,
                                         dq_full, dq_empty, dq_tiles);
            }
        }
        kv += jb.n_tiles;
        if constexpr (FusedDq) mbar_arrive(rows_empty);  // the job's last dQᵀ has read K
        const long long gbase = head_offset(jb.bh, n_h, dkv_sb, dkv_sh);
        frag_store<T, D>(dk + gbase, (int)dkv_st, dk_acc, key0, n_k, scale, scale);
        frag_store<T, D>(dv + gbase, (int)dkv_st, dv_acc, key0, n_k, 1.0f, 1.0f);
    }
    if constexpr (FusedDq) {  // no more tiles: the writer's last stage
        float none[1][BQ / 8][4];
        dq_stage_tile<BQ, D, NS, false>(none, wg, kv, 0, -1, dq_stage, dq_half, dq_full, dq_empty, dq_tiles);
    }
}

// The dot product of two pairs of 16-bit values (each a u32 of a fragment), in fp32.
template <typename T> __device__ __forceinline__ float dot2(u32 a, u32 b) {
    const T* x = reinterpret_cast<const T*>(&a);
    const T* y = reinterpret_cast<const T*>(&b);
    return fmaf(to_float(x[1]), to_float(y[1]), to_float(x[0]) * to_float(y[0]));
}

// dQ for 128 queries a job (consumer 0 the first 64, which see fewer keys): S = Q·Kᵀ, P = exp(S - lse),
// dP = dO·Vᵀ, dS = P∘(dP - delta), dQ += dS·K, over the key tiles the job's last row sees. It runs before
// dK/dV and forms delta = rowsum(dO∘O) itself (attention_bwd_delta's work): each thread's dO fragments and
// the same fragments of O give its part of its two rows' sums, the quad adds them, and lane 0 of the quad
// writes them for the dK/dV kernel. Persistent as the dK/dV kernel: the next job's first K and V tiles load
// while the consumers store this job's dQ and read the next one's Q, dO and O.
template <typename T, int D>
__global__ void __launch_bounds__(kTmaThreads, 1)
    attention_bwd_dq_tma(const __grid_constant__ TmaMap k_map, const __grid_constant__ TmaMap v_map,
                         const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap g_map,
                         const __grid_constant__ TmaMap o_map, const T* __restrict__ q, const T* __restrict__ grad, const T* __restrict__ out,
                         const float* __restrict__ lse, float* __restrict__ delta, T* __restrict__ dq,
                         int* __restrict__ ticket, int n_q, int n_k, int off, int n_h, int n_bh, float scale,
                         KILN_LAYOUT(q), KILN_LAYOUT(o), KILN_LAYOUT(out), KILN_LAYOUT(dq), int group) {
    using Shape = TmaBwdShape<D>;
    constexpr int BN = Shape::ROWS, S = Shape::STAGES;
    extern __shared__ unsigned char dsmem[];
    const u32 base = align1024(dsmem);
    const u32 full = base + Shape::BAR_OFFSET, empty = full + 8 * S, job_full = empty + 8 * S, job_empty = job_full + 8;
    const u32 rows_full = job_empty + 8, rows_empty = rows_full + 8, rows = base + Shape::KV_OFFSET;
    const u32 job_slot = base + Shape::JOB_OFFSET;
    const int n_qb = (n_q + kTmaRows - 1) / kTmaRows, n_work = n_qb * n_bh;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, kTmaThreads - 128);
        }
        mbar_init(job_full, 1);
        mbar_init(job_empty, kTmaThreads - 128);
        mbar_init(rows_full, 1);
        mbar_init(rows_empty, kTmaThreads - 128);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {  // the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kTmaProducerRegs));
        if (threadIdx.x != 0) return;
        int kv = 0;  // key tiles this block has loaded: tile kv goes to stage kv % S, round kv / S
        for (int job = 0;; ++job) {
            const int w = bwd_take_job(job, ticket, job_full, job_empty, job_slot);
            if (w >= n_work) return;
            const TmaJob<BN> jb(w, n_bh, n_qb, group, n_h, n_q, n_k, off);
            if constexpr (Shape::ROWS_SMEM) {  // the job's queries: Q, dO and O, once the consumers hold the last job's
                mbar_wait(rows_empty, (job & 1) ^ 1);
                mbar_expect_tx(rows_full, 3 * Shape::ROWS_TILE_BYTES);
                tma_rows<kTmaRows, BN, D>(rows, q_map, jb.m0, jb.h, jb.b, rows_full);
                tma_rows<kTmaRows, BN, D>(rows + Shape::ROWS_TILE_BYTES, g_map, jb.m0, jb.h, jb.b, rows_full);
                tma_rows<kTmaRows, BN, D>(rows + 2 * Shape::ROWS_TILE_BYTES, o_map, jb.m0, jb.h, jb.b, rows_full);
            }
            for (int it = 0; it < jb.n_tiles; ++it, ++kv) {
                const int s = kv % S;
                mbar_wait(empty + 8 * s, ((kv / S) & 1) ^ 1);  // the consumers are done with tile kv - S
                mbar_expect_tx(full + 8 * s, Shape::STAGE_BYTES);
                const u32 st = base + s * Shape::STAGE_BYTES;
                tma_tile<BN, D>(st, k_map, it * BN, jb.h, jb.b, full + 8 * s);
                tma_tile<BN, D>(st + Shape::TILE_BYTES, v_map, it * BN, jb.h, jb.b, full + 8 * s);
            }
        }
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kTmaConsumerRegs));
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) - 4 * wg, g = lane >> 2, c = lane & 3;
    const float sl2 = scale * kLog2e;
    int kv = 0;  // key tiles consumed so far, in the producer's order
    for (int job = 0;; ++job) {
        const int w = bwd_read_job(job, job_full, job_empty, job_slot);
        if (w >= n_work) break;
        const TmaJob<BN> jb(w, n_bh, n_qb, group, n_h, n_q, n_k, off);
        const int wg_row0 = jb.m0 + (wg - 1) * kTcRows;
        const int row0 = wg_row0 + warp * 16, r_lo = row0 + g, r_hi = r_lo + 8;
        // keys this warpgroup's rows see (none where they all lie past n_q)
        const int wg_k_end = wg_row0 < n_q ? min(n_k, min(wg_row0 + kTcRows, n_q) - 1 + off + 1) : 0;
        const float* const l_row = lse + (long long)jb.bh * n_q;
        const float lse_lo = r_lo < n_q ? l_row[r_lo] * kLog2e : 0.0f;
        const float lse_hi = r_hi < n_q ? l_row[r_hi] * kLog2e : 0.0f;
        u32 qa[D / 16][4], ga[D / 16][4];
        float dl_lo = 0.0f, dl_hi = 0.0f;  // delta of rows r_lo and r_hi (0 past n_q: zero fragments)
        {
            u32 oa[D / 16][4];
            if constexpr (Shape::ROWS_SMEM) {  // this warp's rows of the job's Q, dO and O tiles (zeros past n_q)
                const int r = row0 - jb.m0;
                mbar_wait(rows_full, job & 1);
                frag_load_a_smem<kTmaRows, D>(qa, rows, r);
                frag_load_a_smem<kTmaRows, D>(ga, rows + Shape::ROWS_TILE_BYTES, r);
                frag_load_a_smem<kTmaRows, D>(oa, rows + 2 * Shape::ROWS_TILE_BYTES, r);
                // read through the generic proxy, rewritten by the producer's next TMA (the async proxy)
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                mbar_arrive(rows_empty);
            } else {
                frag_load_a<T, D>(qa, q + head_offset(jb.bh, n_h, q_sb, q_sh), (int)q_st, row0, n_q);
                frag_load_a<T, D>(ga, grad + head_offset(jb.bh, n_h, o_sb, o_sh), (int)o_st, row0, n_q);
                frag_load_a<T, D>(oa, out + head_offset(jb.bh, n_h, out_sb, out_sh), (int)out_st, row0, n_q);
            }
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                dl_lo += dot2<T>(ga[kk][0], oa[kk][0]) + dot2<T>(ga[kk][2], oa[kk][2]);
                dl_hi += dot2<T>(ga[kk][1], oa[kk][1]) + dot2<T>(ga[kk][3], oa[kk][3]);
            }
#pragma unroll
            for (int o_ = 1; o_ <= 2; o_ <<= 1) {
                dl_lo += __shfl_xor_sync(0xffffffffu, dl_lo, o_);
                dl_hi += __shfl_xor_sync(0xffffffffu, dl_hi, o_);
            }
            float* const d_row = delta + (long long)jb.bh * n_q;
            if (c == 0 && r_lo < n_q) d_row[r_lo] = dl_lo;
            if (c == 0 && r_hi < n_q) d_row[r_hi] = dl_hi;
        }
        float dq_acc[D / 8][4];
        zero_acc(dq_acc);
        for (int it = 0; it < jb.n_tiles; ++it) {
            const int s = (kv + it) % S, n0 = it * BN;
            const u32 kb = base + s * Shape::STAGE_BYTES, vb = kb + Shape::TILE_BYTES;
            mbar_wait(full + 8 * s, ((kv + it) / S) & 1);
            if (n0 >= wg_k_end) {  // every key of the tile after this warpgroup's rows (none seen: dq stays 0)
                mbar_arrive(empty + 8 * s);
                continue;
            }
            dq_tile<T, BN, D>(dq_acc, qa, ga, kb, vb, n0, row0, n_k, off, sl2, lse_lo, lse_hi, dl_lo, dl_hi);
            mbar_arrive(empty + 8 * s);
        }
        kv += jb.n_tiles;
        frag_store<T, D>(dq + head_offset(jb.bh, n_h, dq_sb, dq_sh), (int)dq_st, dq_acc, row0, n_q, scale, scale);
    }
}

// ---- float32 under tf32 products: mma.sync m16n8k8 on the TF32 tensor cores ----------------------
//
// In kiln's tf32 mode (matmul precision "tf32") attention's products are matmuls like every GEMM of the
// step, so they take the TF32 tensor cores as cuBLASLt's FAST_TF32 GEMMs do: operands rounded to tf32
// (cvt.rna, a 10-bit mantissa), fp32 accumulation; the softmax, lse and delta stay fp32. Strict fp32 keeps
// the CUDA-core kernels above. 128 threads (4 warps) a block; a warp owns 16 rows (queries in the forward
// and dQ, keys in dK/dV) and walks the streamed tiles of BN rows of the other side. The block's own rows
// and the current tile lie in dynamic shared memory, rows of LD = D + 4 floats (LD % 32 == 4: every
// fragment read below is free of bank conflicts). Each output element is one thread's, summed in a fixed
// order: deterministic, as the other kernels.
// Fragments (PTX ISA, mma.m16n8k8 .tf32; g = lane / 4, c = lane % 4): A (16 x 8, row-major) a0 (g, c),
// a1 (g + 8, c), a2 (g, c + 4), a3 (g + 8, c + 4); B (8 x 8, k x n) b0 (c, g), b1 (c + 4, g); C (16 x 8)
// c0 (g, 2c), c1 (g, 2c + 1), c2 (g + 8, 2c), c3 (g + 8, 2c + 1). A product whose left operand is a C
// fragment (P·V, Pᵀ·dO, dSᵀ·Q, dS·K) takes it as it lies: reduction index c stands for column 2c of the
// 8 and c + 4 for column 2c + 1 (a0 = c0, a1 = c2, a2 = c1, a3 = c3), and the right operand's rows are read
// in that order (b0 from row 2c, b1 from row 2c + 1): no shuffles.

constexpr int kTf32Threads = KILN_ATTN_TF32_THREADS;  // 4 warps x 16 rows
constexpr int kTf32Rows = 4 * 16;                     // the block's own rows

template <int D> struct Tf32Shape {
    static constexpr int BN = D <= 64 ? 64 : 32;  // streamed rows a tile (attention.py's TF32_TILE)
    static constexpr int LD = D + 4;              // floats a row in shared memory
    static_assert(LD % 32 == 4, "conflict-free fragment reads");
};

__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc (16 x N, N / 8 C fragments) += A·Bᵀ, the reduction over K: A the warp's 16 rows and B N rows, both
// row-major in shared memory (row stride LD), offset to their first row.
template <int N, int K, int LD>
__device__ __forceinline__ void tf32_mma_abt(float (&acc)[N / 8][4], const float* A, const float* B, int g, int c) {
#pragma unroll
    for (int k = 0; k < K; k += 8) {
        const float* a = A + g * LD + k + c;
        const u32 af[4] = {to_tf32(a[0]), to_tf32(a[8 * LD]), to_tf32(a[4]), to_tf32(a[8 * LD + 4])};
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            const float* b = B + (8 * j + g) * LD + k + c;
            mma_tf32(acc[j], af, to_tf32(b[0]), to_tf32(b[4]));
        }
    }
}

// acc (16 x E) += P·B, the reduction over N: P the warp's C fragments (16 x N), B N rows of E columns
// row-major in shared memory (row stride LD).
template <int N, int E, int LD>
__device__ __forceinline__ void tf32_mma_pb(float (&acc)[E / 8][4], const float (&p)[N / 8][4], const float* B, int g,
                                            int c) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const u32 af[4] = {to_tf32(p[j][0]), to_tf32(p[j][2]), to_tf32(p[j][1]), to_tf32(p[j][3])};
        const float* b = B + (8 * j + 2 * c) * LD + g;
#pragma unroll
        for (int e = 0; e < E / 8; ++e) mma_tf32(acc[e], af, to_tf32(b[8 * e]), to_tf32(b[LD + 8 * e]));
    }
}

// Rows row0 + g and row0 + g + 8 of acc (16 x D) times mul_lo / mul_hi, where row < n, two floats a store.
template <int D>
__device__ __forceinline__ void tf32_store(float* __restrict__ dst, int ld, const float (&acc)[D / 8][4], int row0,
                                           int n, int g, int c, float mul_lo, float mul_hi) {
    const int r_lo = row0 + g, r_hi = r_lo + 8;
#pragma unroll
    for (int e = 0; e < D / 8; ++e) {
        const int col = 8 * e + 2 * c;
        if (r_lo < n) *reinterpret_cast<float2*>(dst + (r_lo * ld + col)) = make_float2(acc[e][0] * mul_lo, acc[e][1] * mul_lo);
        if (r_hi < n) *reinterpret_cast<float2*>(dst + (r_hi * ld + col)) = make_float2(acc[e][2] * mul_hi, acc[e][3] * mul_hi);
    }
}

// Forward: a block owns 64 query rows of one (b, h), the longest first, and walks the K/V tiles up to the
// last key its last row sees. K(t + 1) lands while P·V(t) runs and V(t + 1) while S(t + 1) does.
template <int D>
__global__ void __launch_bounds__(kTf32Threads)
    attention_fwd_tf32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       float* __restrict__ out, float* __restrict__ lse, int n_q, int n_k, int off, int n_h, float scale,
                       KILN_LAYOUT(q), KILN_LAYOUT(kv), KILN_LAYOUT(o)) {
    using S = Tf32Shape<D>;
    constexpr int BN = S::BN, LD = S::LD, BQ = kTf32Rows;
    extern __shared__ __align__(16) float tf32_smem[];
    float* Qs = tf32_smem;    // [BQ][LD]
    float* Ks = Qs + BQ * LD;  // [BN][LD]
    float* Vs = Ks + BN * LD;  // [BN][LD]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const long long base = head_offset(blockIdx.y, n_h, kv_sb, kv_sh);
    const float* kb = k + base;
    const float* vb = v + base;
    const int ld = (int)kv_st;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    const int row0 = q0 + 16 * warp;                    // the warp's first row
    const int k_end = min(n_k, min(q0 + BQ, n_q) - 1 + off + 1);  // keys some row of the block sees
    const int n_tiles = (k_end - 1) / BN + 1;
    f32_rows_async<BQ, D, LD, kTf32Threads>(Qs, q + head_offset(blockIdx.y, n_h, q_sb, q_sh), (int)q_st, q0, n_q);
    f32_rows_async<BN, D, LD, kTf32Threads>(Ks, kb, ld, 0, n_k);
    cp_async_commit();
    f32_rows_async<BN, D, LD, kTf32Threads>(Vs, vb, ld, 0, n_k);
    cp_async_commit();
    const float sl2 = scale * kF32Log2e;  // scores in log2 units
    float m_lo = -KILN_INF, m_hi = -KILN_INF, l_lo = 0.0f, l_hi = 0.0f, o[D / 8][4], s[BN / 8][4];
    zero_acc(o);
    for (int t = 0; t < n_tiles; ++t) {
        const int k0 = t * BN;
        cp_async_wait_group<1>();  // Q and K(t) have landed (V(t) may still be in flight)
        __syncthreads();           // ... for everyone
        // A warp whose rows all precede this tile's keys skips it; every warp takes tile 0 (key 0 is
        // seen by every row), so m is finite from then on.
        const bool active = k0 <= row0 + 15 + off;
        if (active) {
            zero_acc(s);
            tf32_mma_abt<BN, D, LD>(s, Qs + 16 * warp * LD, Ks, g, c);
            float a_lo, a_hi;
            tma_softmax_tile<BN>(s, k0, row0, row0 + g, row0 + g + 8, c, off, n_k, sl2, m_lo, m_hi, l_lo, l_hi, a_lo,
                                 a_hi);
#pragma unroll
            for (int e = 0; e < D / 8; ++e) {
                o[e][0] *= a_lo;
                o[e][1] *= a_lo;
                o[e][2] *= a_hi;
                o[e][3] *= a_hi;
            }
        }
        cp_async_wait_group<0>();  // V(t) has landed
        __syncthreads();           // ... for everyone; everyone is done with Ks
        if (t + 1 < n_tiles) {
            f32_rows_async<BN, D, LD, kTf32Threads>(Ks, kb, ld, k0 + BN, n_k);
            cp_async_commit();
        }
        if (active) tf32_mma_pb<BN, D, LD>(o, s, Vs, g, c);
        __syncthreads();  // everyone is done with Vs
        if (t + 1 < n_tiles) {
            f32_rows_async<BN, D, LD, kTf32Threads>(Vs, vb, ld, k0 + BN, n_k);
            cp_async_commit();
        }
    }
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {  // the quad's parts of the row sums
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o_);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o_);
    }
    tf32_store<D>(out + head_offset(blockIdx.y, n_h, o_sb, o_sh), (int)o_st, o, row0, n_q, g, c, 1.0f / l_lo,
                  1.0f / l_hi);
    float* const lrow = lse + (long long)blockIdx.y * n_q;
    if (c == 0 && row0 + g < n_q) lrow[row0 + g] = (m_lo + log2f(l_lo)) * kF32Ln2;
    if (c == 0 && row0 + g + 8 < n_q) lrow[row0 + g + 8] = (m_hi + log2f(l_hi)) * kF32Ln2;
}

// dK and dV: a block owns 64 keys (a warp 16), the first keys (seen by the most queries) launched first, and
// walks the query tiles that see them: Sᵀ = K·Qᵀ -> Pᵀ, dPᵀ = V·dOᵀ -> dSᵀ = Pᵀ∘(dPᵀ - delta), then
// dV += Pᵀ·dO and dK += dSᵀ·Q, all in the warp's registers.
template <int D>
__global__ void __launch_bounds__(kTf32Threads) attention_bwd_dkdv_tf32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ grad, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dk, float* __restrict__ dv, int n_q, int n_k, int off, int n_h, float scale, KILN_LAYOUT(q),
    KILN_LAYOUT(kv), KILN_LAYOUT(o), KILN_LAYOUT(dkv)) {
    using S = Tf32Shape<D>;
    constexpr int BN = S::BN, LD = S::LD, BK = kTf32Rows;
    extern __shared__ __align__(16) float tf32_smem[];
    float* Ks = tf32_smem;     // [BK][LD]
    float* Vs = Ks + BK * LD;  // [BK][LD]
    float* Qs = Vs + BK * LD;  // [BN][LD]
    float* Gs = Qs + BN * LD;  // [BN][LD]
    float* Ls = Gs + BN * LD;  // [BN]
    float* Ds = Ls + BN;       // [BN]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const long long base = head_offset(blockIdx.y, n_h, kv_sb, kv_sh), rbase = (long long)blockIdx.y * n_q;
    const float* qb = q + head_offset(blockIdx.y, n_h, q_sb, q_sh);
    const float* gb = grad + head_offset(blockIdx.y, n_h, o_sb, o_sh);
    const int ld = (int)q_st, ldo = (int)o_st;
    const int k0 = blockIdx.x * BK;
    const int key0 = k0 + 16 * warp;                   // the warp's first key
    const int q_begin = (max(k0 - off, 0) / BN) * BN;  // the first query tile that sees key k0
    const int n_tiles = q_begin < n_q ? (n_q - q_begin + BN - 1) / BN : 0;
    const float sl2 = scale * kF32Log2e;
    f32_rows_async<BK, D, LD, kTf32Threads>(Ks, k + base, (int)kv_st, k0, n_k);
    f32_rows_async<BK, D, LD, kTf32Threads>(Vs, v + base, (int)kv_st, k0, n_k);
    if (n_tiles > 0) {
        f32_rows_async<BN, D, LD, kTf32Threads>(Qs, qb, ld, q_begin, n_q);
        f32_rows_async<BN, D, LD, kTf32Threads>(Gs, gb, ldo, q_begin, n_q);
        f32_vec_async<BN, kTf32Threads>(Ls, lse + rbase, q_begin, n_q);
        f32_vec_async<BN, kTf32Threads>(Ds, delta + rbase, q_begin, n_q);
    }
    cp_async_commit();
    float dk_acc[D / 8][4], dv_acc[D / 8][4], st[BN / 8][4], dpt[BN / 8][4];
    zero_acc(dk_acc);
    zero_acc(dv_acc);
    for (int it = 0; it < n_tiles; ++it) {
        const int i0 = q_begin + it * BN;
        cp_async_wait_all();
        __syncthreads();  // the query tile has landed for everyone (and K, V at it = 0)
        // the warp's keys are seen by some query of the tile (and exist)
        if (i0 + BN - 1 + off >= key0 && key0 < n_k) {
            zero_acc(st);
            zero_acc(dpt);
            tf32_mma_abt<BN, D, LD>(st, Ks + 16 * warp * LD, Qs, g, c);
            tf32_mma_abt<BN, D, LD>(dpt, Vs + 16 * warp * LD, Gs, g, c);
            const bool edge = i0 + off < key0 + 15 || i0 + BN > n_q;  // some (key, query) pair is masked
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qi = 8 * j + 2 * c + (e & 1), query = i0 + qi, key = key0 + g + 8 * (e >> 1);
                    float p = ex2(fmaf(st[j][e], sl2, -Ls[qi] * kF32Log2e));
                    if (edge && !(key <= query + off && query < n_q)) p = 0.0f;
                    st[j][e] = p;
                    dpt[j][e] = p * (dpt[j][e] - Ds[qi]);
                }
            }
            tf32_mma_pb<BN, D, LD>(dv_acc, st, Gs, g, c);
            tf32_mma_pb<BN, D, LD>(dk_acc, dpt, Qs, g, c);
        }
        __syncthreads();  // everyone is done with this query tile
        if (it + 1 < n_tiles) {
            const int i1 = i0 + BN;
            f32_rows_async<BN, D, LD, kTf32Threads>(Qs, qb, ld, i1, n_q);
            f32_rows_async<BN, D, LD, kTf32Threads>(Gs, gb, ldo, i1, n_q);
            f32_vec_async<BN, kTf32Threads>(Ls, lse + rbase, i1, n_q);
            f32_vec_async<BN, kTf32Threads>(Ds, delta + rbase, i1, n_q);
            cp_async_commit();
        }
    }
    const long long dbase = head_offset(blockIdx.y, n_h, dkv_sb, dkv_sh);
    tf32_store<D>(dk + dbase, (int)dkv_st, dk_acc, key0, n_k, g, c, scale, scale);
    tf32_store<D>(dv + dbase, (int)dkv_st, dv_acc, key0, n_k, g, c, 1.0f, 1.0f);
}

// dQ: a block owns 64 queries (a warp 16), the longest first, and walks the K/V tiles they see:
// S = Q·Kᵀ -> P, dP = dO·Vᵀ -> dS = P∘(dP - delta), then dQ += dS·K.
template <int D>
__global__ void __launch_bounds__(kTf32Threads) attention_bwd_dq_tf32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ grad, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dq, int n_q, int n_k, int off, int n_h, float scale, KILN_LAYOUT(q), KILN_LAYOUT(kv),
    KILN_LAYOUT(o), KILN_LAYOUT(dq)) {
    using S = Tf32Shape<D>;
    constexpr int BN = S::BN, LD = S::LD, BQ = kTf32Rows;
    extern __shared__ __align__(16) float tf32_smem[];
    float* Qs = tf32_smem;     // [BQ][LD]
    float* Gs = Qs + BQ * LD;  // [BQ][LD]
    float* Ks = Gs + BQ * LD;  // [BN][LD]
    float* Vs = Ks + BN * LD;  // [BN][LD]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const long long base = head_offset(blockIdx.y, n_h, kv_sb, kv_sh), rbase = (long long)blockIdx.y * n_q;
    const float* kb = k + base;
    const float* vb = v + base;
    const int ld = (int)kv_st;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    const int row0 = q0 + 16 * warp;
    const int r_lo = row0 + g, r_hi = r_lo + 8;
    const int k_end = min(n_k, min(q0 + BQ, n_q) - 1 + off + 1);  // keys some row of the block sees
    const int n_tiles = (k_end - 1) / BN + 1;
    f32_rows_async<BQ, D, LD, kTf32Threads>(Qs, q + head_offset(blockIdx.y, n_h, q_sb, q_sh), (int)q_st, q0, n_q);
    f32_rows_async<BQ, D, LD, kTf32Threads>(Gs, grad + head_offset(blockIdx.y, n_h, o_sb, o_sh), (int)o_st, q0, n_q);
    f32_rows_async<BN, D, LD, kTf32Threads>(Ks, kb, ld, 0, n_k);
    f32_rows_async<BN, D, LD, kTf32Threads>(Vs, vb, ld, 0, n_k);
    cp_async_commit();
    const float sl2 = scale * kF32Log2e;
    const float lq_lo = r_lo < n_q ? lse[rbase + r_lo] * kF32Log2e : 0.0f;
    const float lq_hi = r_hi < n_q ? lse[rbase + r_hi] * kF32Log2e : 0.0f;
    const float dl_lo = r_lo < n_q ? delta[rbase + r_lo] : 0.0f;
    const float dl_hi = r_hi < n_q ? delta[rbase + r_hi] : 0.0f;
    float dq_acc[D / 8][4], s[BN / 8][4], dp[BN / 8][4];
    zero_acc(dq_acc);
    for (int t = 0; t < n_tiles; ++t) {
        const int k0 = t * BN;
        cp_async_wait_all();
        __syncthreads();  // the key/value tile has landed for everyone (and Q, dO at t = 0)
        if (k0 <= row0 + 15 + off) {  // some row of the warp sees some key of the tile
            zero_acc(s);
            zero_acc(dp);
            tf32_mma_abt<BN, D, LD>(s, Qs + 16 * warp * LD, Ks, g, c);
            tf32_mma_abt<BN, D, LD>(dp, Gs + 16 * warp * LD, Vs, g, c);
            const bool edge = k0 + BN - 1 > row0 + off || k0 + BN > n_k;  // some key hidden from some row
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + 8 * j + 2 * c + (e & 1), row = e < 2 ? r_lo : r_hi;
                    float p = ex2(fmaf(s[j][e], sl2, -(e < 2 ? lq_lo : lq_hi)));
                    if (edge && (key > row + off || key >= n_k)) p = 0.0f;
                    s[j][e] = p * (dp[j][e] - (e < 2 ? dl_lo : dl_hi));
                }
            }
            tf32_mma_pb<BN, D, LD>(dq_acc, s, Ks, g, c);
        }
        __syncthreads();  // everyone is done with this tile
        if (t + 1 < n_tiles) {
            f32_rows_async<BN, D, LD, kTf32Threads>(Ks, kb, ld, k0 + BN, n_k);
            f32_rows_async<BN, D, LD, kTf32Threads>(Vs, vb, ld, k0 + BN, n_k);
            cp_async_commit();
        }
    }
    tf32_store<D>(dq + head_offset(blockIdx.y, n_h, dq_sb, dq_sh), (int)dq_st, dq_acc, row0, n_q, g, c, scale, scale);
}
