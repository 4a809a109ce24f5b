// Deterministic column sums over rows (a bias or LayerNorm parameter gradient): out[c] = the sum over
// rows r of e[r][c], in two fixed-order steps and no atomics, so the bits are the same on every run.
//   1. Parts: block (bx, part) sums rows [part * rows_per_part, +rows_per_part) of its columns into one
//      fp32 row partial[part][C] (column_sum_part_rows below; layer_norm.cu's backward writes its own).
//   2. column_sum_finish adds the parts' rows in a fixed order and writes the output dtype.
#pragma once

#include "common.cuh"

namespace kiln {

// The part step's skeleton over e[rows, C]: `elems` gives the row-major elements it sums, a 16-byte pack
// (`pack(off)`, kVec) or one element (`one(off)`) at offset off, and may do the pass's other work there
// (gelu.cu's writes dx and sums it). kVec: a thread owns one pack of columns (the host checked
// C % Pack::N == 0 and the alignment), else one column; blocks of the x axis take consecutive columns.
template <typename T, bool kVec, typename Elems>
__device__ __forceinline__ void column_sum_part_rows(Elems elems, float* __restrict__ partial, int rows, int C,
                                                     int rows_per_part) {
    constexpr int V = kVec ? Pack<T>::N : 1;
    const int col = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (col >= C) return;
    const int r0 = blockIdx.y * rows_per_part;
    const int r1 = min(r0 + rows_per_part, rows);
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.0f;
#pragma unroll 4
    for (int r = r0; r < r1; ++r) {
        const long long off = (long long)r * C + col;
        if constexpr (kVec) {
            const Pack<T> p = elems.pack(off);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += to_float(p.v[j]);
        } else {
            acc[0] += to_float(elems.one(off));
        }
    }
    float* __restrict__ out = partial + (long long)blockIdx.y * C + col;
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = acc[j];
}

// The elements of a as stored (matmul.cu's bias gradient).
template <typename T>
struct StoredElems {
    const T* __restrict__ a;
    __device__ __forceinline__ Pack<T> pack(long long off) const { return load_pack(a + off); }
    __device__ __forceinline__ T one(long long off) const { return a[off]; }
};

}  // namespace kiln

// out_y[c] = the sum over k < parts of partial[y * parts + k][c] for y = blockIdx.y (out0, out1; a null
// out is skipped). A block takes kCols columns of every part (kCols * 4 bytes of each partial row: 32 with
// kCols = 8, one L2 sector) so that even GPT-2's C = 768 spreads over ~100 blocks. Its threads are
// (column lane, part lane): kVec (the host checked C % 4 == 0 and 16-byte rows) gives kCols / 4 column
// lanes of one float4, else kCols lanes of one float; part lane p adds parts p, p + P, ... (P part lanes,
// kFinishUnroll loads in flight at a time). The part lanes' sums are then added in a fixed order: an xor
// butterfly within the warp, then the warps' sums in warp order. Deterministic; the order is not the rows'.
// Until 2026-12-04 a block took 32 columns and 8 part lanes: 24 blocks for C = 768, each warp adding
// parts / 8 scalar loads one after another (14.5 us a call in the bf16 GPT-2 step, 3% of it).
constexpr int kFinishUnroll = 4;

template <typename T, int kCols, bool kVec>
__global__ void __launch_bounds__(1024) column_sum_finish(const float* __restrict__ partial, int parts, int C,
                                                          T* __restrict__ out0, T* __restrict__ out1) {
    constexpr int V = kVec ? 4 : 1;  // floats a lane loads at once
    constexpr int L = kCols / V;     // column lanes
    static_assert(kCols % V == 0 && L <= 32 && (L & (L - 1)) == 0, "column lanes must be a power of two <= 32");
    T* __restrict__ out = blockIdx.y == 0 ? out0 : out1;
    if (out == nullptr) return;
    __shared__ float sums[32][kCols];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int c = blockIdx.x * kCols + (lane % L) * V;  // this lane's first column
    const int part_lanes = blockDim.x / L;
    const float* __restrict__ rows = partial + (long long)blockIdx.y * parts * C;
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.0f;
    if (c < C) {
        for (int k = threadIdx.x / L; k < parts; k += kFinishUnroll * part_lanes) {
            float v[kFinishUnroll][V];  // every load of the batch issued before the first add
#pragma unroll
            for (int u = 0; u < kFinishUnroll; ++u) {
                const int ku = k + u * part_lanes;
                const float* __restrict__ p = rows + (long long)ku * C + c;
                if constexpr (kVec) {
                    const float4 f = ku < parts ? kiln::load_f4(p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    v[u][0] = f.x;
                    v[u][1] = f.y;
                    v[u][2] = f.z;
                    v[u][3] = f.w;
                } else {
                    v[u][0] = ku < parts ? *p : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < kFinishUnroll; ++u)
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] += v[u][j];
        }
    }
#pragma unroll
    for (int o = L; o < 32; o <<= 1)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    if (lane < L)
#pragma unroll
        for (int j = 0; j < V; ++j) sums[warp][lane * V + j] = acc[j];
    __syncthreads();
    const int col = blockIdx.x * kCols + threadIdx.x;
    if (threadIdx.x < kCols && col < C) {
        float s = 0.0f;
        for (int w = 0; w < warps; ++w) s += sums[w][threadIdx.x];
        out[col] = kiln::from_float<T>(s);
    }
}
