// GELU in GPT-2's tanh form, forward and backward: elementwise, 16-byte packs, fp32 math.
// The host passes n_vec = n / Pack::N when every pointer is 16-byte aligned (else 0); the
// tail and unaligned arrays take the scalar loop.
#include "column_sum.cuh"

namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(kGeluK * (x + kGeluC * x * x * x)));
}

__device__ __forceinline__ float gelu_grad(float x) {
    const float x2 = x * x;
    const float t = tanhf(kGeluK * x * (1.0f + kGeluC * x2));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * (kGeluK * (1.0f + 3.0f * kGeluC * x2));
}

}  // namespace

template <typename T>
__global__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, long long n, long long n_vec) {
    using namespace kiln;
    constexpr int V = Pack<T>::N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long p = i; p < n_vec; p += stride) {
        const Pack<T> a = load_pack(x + p * V);
        Pack<T> o;
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(gelu(to_float(a.v[j])));
        store_pack(y + p * V, o);
    }
    for (long long e = n_vec * V + i; e < n; e += stride) y[e] = from_float<T>(gelu(to_float(x[e])));
}

template <typename T>
__global__ void gelu_bwd(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ dx,
                         long long n, long long n_vec) {
    using namespace kiln;
    constexpr int V = Pack<T>::N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long p = i; p < n_vec; p += stride) {
        const Pack<T> a = load_pack(x + p * V);
        const Pack<T> b = load_pack(g + p * V);
        Pack<T> o;
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(to_float(b.v[j]) * gelu_grad(to_float(a.v[j])));
        store_pack(dx + p * V, o);
    }
    for (long long e = n_vec * V + i; e < n; e += stride)
        dx[e] = from_float<T>(to_float(g[e]) * gelu_grad(to_float(x[e])));
}

// gelu_bwd of x [rows, C] that also sums dx (as stored, rounded to T) over the rows: the bias
// gradient of the linear layer before the GELU rides in the pass that makes dx, instead of a
// second read of dx (cuBLASLt's BGRADB runs one). The part step of column_sum.cuh over the
// elements GeluBwdElems makes (and stores), then column_sum_finish.
template <typename T>
struct GeluBwdElems {
    const T* __restrict__ g;
    const T* __restrict__ x;
    T* __restrict__ dx;
    __device__ __forceinline__ kiln::Pack<T> pack(long long off) const {
        using namespace kiln;
        const Pack<T> a = load_pack(x + off);
        const Pack<T> b = load_pack(g + off);
        Pack<T> o;
#pragma unroll
        for (int j = 0; j < Pack<T>::N; ++j) o.v[j] = from_float<T>(to_float(b.v[j]) * gelu_grad(to_float(a.v[j])));
        store_pack(dx + off, o);
        return o;
    }
    __device__ __forceinline__ T one(long long off) const {
        using namespace kiln;
        const T o = from_float<T>(to_float(g[off]) * gelu_grad(to_float(x[off])));
        dx[off] = o;
        return o;
    }
};

template <typename T, bool kVec>
__global__ void gelu_bwd_bias_part(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ dx,
                                   float* __restrict__ partial, int rows, int C, int rows_per_part) {
    kiln::column_sum_part_rows<T, kVec>(GeluBwdElems<T>{g, x, dx}, partial, rows, C, rows_per_part);
}
