// Softmax and log-softmax over the last axis of x[N, C], forward and backward from the
// saved output. One block per row; the forward is one online (max, sum) pass plus a write
// pass; 16-byte packs when the row length and pointers allow (a uniform runtime branch).
#include "common.cuh"

using namespace kiln;

constexpr int kSmThreads = KILN_SM_THREADS;  // threads per row (softmax.py)

namespace {

// sum over the row of f(a[c], b[c]).
template <typename T, typename F>
__device__ __forceinline__ float row_sum2(const T* __restrict__ a, const T* __restrict__ b, int C, bool vec, F f) {
    constexpr int V = Pack<T>::N;
    float s = 0.0f;
    if (vec) {
        for (int p = threadIdx.x; p < C / V; p += kSmThreads) {
            const Pack<T> pa = load_pack(a + p * V);
            const Pack<T> pb = load_pack(b + p * V);
#pragma unroll
            for (int j = 0; j < V; ++j) s += f(to_float(pa.v[j]), to_float(pb.v[j]));
        }
    } else {
        for (int c = threadIdx.x; c < C; c += kSmThreads) s += f(to_float(a[c]), to_float(b[c]));
    }
    __shared__ float scratch[kSmThreads / 32];
    return block_sum<kSmThreads>(s, scratch);
}

// out[c] = f(a[c], b[c]) over the row.
template <typename T, typename F>
__device__ __forceinline__ void row_map2(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                         int C, bool vec, F f) {
    constexpr int V = Pack<T>::N;
    if (vec) {
        for (int p = threadIdx.x; p < C / V; p += kSmThreads) {
            const Pack<T> pa = load_pack(a + p * V);
            const Pack<T> pb = load_pack(b + p * V);
            Pack<T> o;
#pragma unroll
            for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(f(to_float(pa.v[j]), to_float(pb.v[j])));
            store_pack(out + p * V, o);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += kSmThreads) out[c] = from_float<T>(f(to_float(a[c]), to_float(b[c])));
    }
}

template <typename T>
__device__ __forceinline__ bool row_vec(int C, const T* a, const T* b, const T* c) {
    return C % Pack<T>::N == 0 && aligned16(a) && aligned16(b) && aligned16(c);
}

}  // namespace

template <typename T>
__global__ void __launch_bounds__(kSmThreads) softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int C) {
    const long long off = (long long)blockIdx.x * C;
    const bool vec = row_vec(C, x, y, y);
    const MaxSum st = row_max_sum<kSmThreads>(x + off, C, vec);
    const float m = st.m, inv = 1.0f / st.s;
    row_map2(x + off, x + off, y + off, C, vec, [=](float v, float) { return expf(v - m) * inv; });
}

template <typename T>
__global__ void __launch_bounds__(kSmThreads) log_softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int C) {
    const long long off = (long long)blockIdx.x * C;
    const bool vec = row_vec(C, x, y, y);
    const MaxSum st = row_max_sum<kSmThreads>(x + off, C, vec);
    const float shift = st.m + logf(st.s);
    row_map2(x + off, x + off, y + off, C, vec, [=](float v, float) { return v - shift; });
}

// dx = y * (g - sum(g * y))
template <typename T>
__global__ void __launch_bounds__(kSmThreads) softmax_bwd(const T* __restrict__ g, const T* __restrict__ y,
                                                          T* __restrict__ dx, int C) {
    const long long off = (long long)blockIdx.x * C;
    const bool vec = row_vec(C, g, y, dx);
    const float dot = row_sum2(g + off, y + off, C, vec, [](float a, float b) { return a * b; });
    row_map2(g + off, y + off, dx + off, C, vec, [=](float a, float b) { return b * (a - dot); });
}

// dx = g - exp(y) * sum(g)
template <typename T>
__global__ void __launch_bounds__(kSmThreads) log_softmax_bwd(const T* __restrict__ g, const T* __restrict__ y,
                                                              T* __restrict__ dx, int C) {
    const long long off = (long long)blockIdx.x * C;
    const bool vec = row_vec(C, g, y, dx);
    const float sum = row_sum2(g + off, g + off, C, vec, [](float a, float) { return a; });
    row_map2(g + off, y + off, dx + off, C, vec, [=](float a, float b) { return a - expf(b) * sum; });
}
