// Embedding lookup and its deterministic backward.
//
// Forward: one warp per output row copies weight[idx] (16-byte packs when aligned); an index
// outside [0, V) gives a row of NaN instead of an out-of-bounds read (no host-side check).
// Backward: the host sorts the flat indices (stable argsort, on the device); one block per
// sorted position that starts a run of equal indices sums the run's grad rows in order, so
// every dweight row is written by one block, with no atomics: the result is deterministic.
#include "common.cuh"

using namespace kiln;

template <typename T, typename I>
__global__ void __launch_bounds__(256) embedding_fwd(const T* __restrict__ weight, const I* __restrict__ idx,
                                                     T* __restrict__ out, int n, int C, long long V) {
    constexpr int P = Pack<T>::N;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= n) return;
    const long long t = (long long)idx[row];
    T* o = out + (long long)row * C;
    if (t < 0 || t >= V) {
        for (int c = lane; c < C; c += 32) o[c] = from_float<T>(KILN_NAN);
        return;
    }
    const T* w = weight + t * C;
    if (C % P == 0 && aligned16(weight) && aligned16(out)) {
        for (int p = lane; p < C / P; p += 32) store_pack(o + p * P, load_pack(w + p * P));
    } else {
        for (int c = lane; c < C; c += 32) o[c] = w[c];
    }
}

constexpr int kEmbThreads = 128;
constexpr int kEmbCols = 8;  // columns per thread per pass

template <typename T, typename I>
__global__ void __launch_bounds__(kEmbThreads) embedding_bwd(const T* __restrict__ grad, const I* __restrict__ idx,
                                                             const long long* __restrict__ order,
                                                             T* __restrict__ dweight, int n, int C, long long V) {
    const int i = blockIdx.x;
    const long long tok = (long long)idx[order[i]];
    if (i > 0 && (long long)idx[order[i - 1]] == tok) return;  // not the start of a run
    if (tok < 0 || tok >= V) return;
    T* dw = dweight + tok * C;
    for (int c0 = threadIdx.x; c0 < C; c0 += kEmbThreads * kEmbCols) {
        float acc[kEmbCols];
#pragma unroll
        for (int u = 0; u < kEmbCols; ++u) acc[u] = 0.0f;
        for (int k = i; k < n; ++k) {
            const long long src = order[k];
            if ((long long)idx[src] != tok) break;
            const T* g = grad + src * C;
#pragma unroll
            for (int u = 0; u < kEmbCols; ++u) {
                const int c = c0 + u * kEmbThreads;
                if (c < C) acc[u] += to_float(g[c]);
            }
        }
#pragma unroll
        for (int u = 0; u < kEmbCols; ++u) {
            const int c = c0 + u * kEmbThreads;
            if (c < C) dw[c] = from_float<T>(acc[u]);
        }
    }
}
