// The linear layer's bias gradient, dbias[c] = the sum over rows of grad[r][c] (its GEMMs are
// cuBLASLt's, backend/cuda/matmul.py): block (bx, part) sums rows [part * rows_per_part,
// +rows_per_part) of its columns into partial[part][C] (fp32), and column_sum_finish (common.cuh)
// adds the parts in a fixed order (deterministic, no atomics). Reads only: one pass over grad.
// kVec: a thread owns one 16-byte pack of columns (the host checked C % Pack::N == 0 and the
// alignment), else one column.
#include "common.cuh"

template <typename T, bool kVec>
__global__ void column_sum_part(const T* __restrict__ a, float* __restrict__ partial, int rows, int C,
                                int rows_per_part) {
    using namespace kiln;
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
            const Pack<T> p = load_pack(a + off);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += to_float(p.v[j]);
        } else {
            acc[0] += to_float(a[off]);
        }
    }
    float* __restrict__ out = partial + (long long)blockIdx.y * C + col;
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = acc[j];
}
