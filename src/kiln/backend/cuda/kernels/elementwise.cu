// Elementwise add and dtype casts: memory-bound, so 16-byte accesses and nothing else. CuPy's
// generic elementwise kernels reach ~0.4 TB/s on bf16 on the H200 (the residual adds and the
// gradient sums of a GPT-2 step took 2.9 ms there); these are plain vector loops.
// The host passes n_vec = n / 8 when every pointer is 16-byte aligned (else 0): 8 elements are
// one 16-byte pack of a 2-byte type, two of float. The tail and unaligned arrays take the
// scalar loop.
#include "common.cuh"

using namespace kiln;

namespace {

// 8 elements of T to and from fp32, with 16-byte accesses (two for float).
template <typename T> struct Vec8 {
    static __device__ __forceinline__ void load(const T* p, float (&f)[8]) {
        const Pack<T> a = load_pack(p);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = to_float(a.v[j]);
    }
    static __device__ __forceinline__ void store(T* p, const float (&f)[8]) {
        Pack<T> a;
#pragma unroll
        for (int j = 0; j < 8; ++j) a.v[j] = from_float<T>(f[j]);
        store_pack(p, a);
    }
};
template <> struct Vec8<float> {
    static __device__ __forceinline__ void load(const float* p, float (&f)[8]) {
        const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
        f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
    static __device__ __forceinline__ void store(float* p, const float (&f)[8]) {
        reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
};

}  // namespace

// out = a + b, same dtype and shape, computed in fp32 (as CuPy does for bf16).
template <typename T>
__global__ void add(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, long long n,
                    long long n_vec) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long p = i; p < n_vec; p += stride) {
        float x[8], y[8];
        Vec8<T>::load(a + 8 * p, x);
        Vec8<T>::load(b + 8 * p, y);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] += y[j];
        Vec8<T>::store(out + 8 * p, x);
    }
    for (long long e = 8 * n_vec + i; e < n; e += stride) out[e] = from_float<T>(to_float(a[e]) + to_float(b[e]));
}

// y = x converted to TO (round to nearest even), e.g. fp32 master weights to bf16 and back.
template <typename TI, typename TO>
__global__ void cast(const TI* __restrict__ x, TO* __restrict__ y, long long n, long long n_vec) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long p = i; p < n_vec; p += stride) {
        float f[8];
        Vec8<TI>::load(x + 8 * p, f);
        Vec8<TO>::store(y + 8 * p, f);
    }
    for (long long e = 8 * n_vec + i; e < n; e += stride) y[e] = from_float<TO>(to_float(x[e]));
}
