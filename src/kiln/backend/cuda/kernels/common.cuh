// Shared device helpers for kiln's kernels: dtype conversion, 16-byte packs, warp and block
// reductions. Every kernel computes in fp32 and stores in its input dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define KILN_INF __int_as_float(0x7f800000)
#define KILN_NAN __int_as_float(0x7fffffff)

namespace kiln {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// 16 bytes of T, loaded and stored as one 128-bit access (the caller guarantees alignment).
template <typename T>
struct alignas(16) Pack {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
    Pack<T> out;
    *reinterpret_cast<int4*>(&out) = *reinterpret_cast<const int4*>(p);
    return out;
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& x) {
    *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Online-softmax state (running max m, sum of exp(x - m)) merged in a fixed order.
struct MaxSum {
    float m;
    float s;
};

__device__ __forceinline__ MaxSum max_sum_merge(MaxSum a, MaxSum b) {
    float m = fmaxf(a.m, b.m);
    if (m == -KILN_INF) return {m, 0.0f};
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_max_sum(MaxSum x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        MaxSum y{__shfl_xor_sync(0xffffffffu, x.m, o), __shfl_xor_sync(0xffffffffu, x.s, o)};
        x = max_sum_merge(x, y);
    }
    return x;
}

// Block-wide reductions for NT threads (a multiple of 32); every thread gets the result.
// `scratch` needs NT / 32 floats (two arrays for the max-sum pair); the trailing barrier
// makes it safe to call these again with the same scratch.
template <int NT>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    constexpr int NW = NT / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (NW == 1) return v;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) t += scratch[w];  // same order in every thread: deterministic
    __syncthreads();
    return t;
}

template <int NT>
__device__ __forceinline__ MaxSum block_max_sum(MaxSum x, float* scratch_m, float* scratch_s) {
    constexpr int NW = NT / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    x = warp_max_sum(x);
    if (NW == 1) return x;
    if (lane == 0) {
        scratch_m[warp] = x.m;
        scratch_s[warp] = x.s;
    }
    __syncthreads();
    MaxSum t{scratch_m[0], scratch_s[0]};
#pragma unroll
    for (int w = 1; w < NW; ++w) t = max_sum_merge(t, MaxSum{scratch_m[w], scratch_s[w]});
    __syncthreads();
    return t;
}

// True when p is 16-byte aligned, so Pack loads are legal.
template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

// Four consecutive elements as floats: one 16-byte access for fp32, one 8-byte access for
// 16-bit types (the caller guarantees 4 * sizeof(T) alignment; see vec4_aligned).
template <typename T>
__device__ __forceinline__ bool vec4_aligned(const T* p) {
    return (reinterpret_cast<unsigned long long>(p) & (4ull * sizeof(T) - 1ull)) == 0ull;
}

__device__ __forceinline__ float4 load_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }
template <typename T>
__device__ __forceinline__ float4 load_f4(const T* p) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
    return make_float4(to_float(h[0]), to_float(h[1]), to_float(h[2]), to_float(h[3]));
}

__device__ __forceinline__ void store_f4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
template <typename T>
__device__ __forceinline__ void store_f4(T* p, float4 v) {
    uint2 raw;
    T* h = reinterpret_cast<T*>(&raw);
    h[0] = from_float<T>(v.x);
    h[1] = from_float<T>(v.y);
    h[2] = from_float<T>(v.z);
    h[3] = from_float<T>(v.w);
    *reinterpret_cast<uint2*>(p) = raw;
}

// The online (max, sum of exp(x - max)) of one row xr[0:C], reduced over a block of NT threads:
// the log-sum-exp pass of softmax.cu and cross_entropy.cu. `vec`: read 16-byte packs (the
// caller checked C % Pack<T>::N == 0 and the alignment). Every thread gets the row's result.
// `keep` (shared memory, or null): each thread also stores there the elements it read, at their
// own offsets, so a second pass over the row by the same threads with the same stride reads them
// back without a barrier and without reading the row from global memory again.
template <int NT, typename T>
__device__ __forceinline__ MaxSum row_max_sum(const T* __restrict__ xr, int C, bool vec,
                                              T* __restrict__ keep = nullptr) {
    constexpr int V = Pack<T>::N;
    MaxSum st{-KILN_INF, 0.0f};
    if (vec) {
        // four packs a thread loaded before any is summed (a kept row's block has half the SM's threads,
        // so each needs more loads in flight); summed in the order p, p + NT, p + 2 NT, ... all the same
        constexpr int U = 4;
        const int packs = C / V;
        for (int p0 = threadIdx.x; p0 < packs; p0 += U * NT) {
            Pack<T> a[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (p0 + u * NT < packs) a[u] = load_pack(xr + (p0 + u * NT) * V);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (p0 + u * NT >= packs) break;
                if (keep != nullptr) store_pack(keep + (p0 + u * NT) * V, a[u]);
                float v[V];
                float pm = -KILN_INF;
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    v[j] = to_float(a[u].v[j]);
                    pm = fmaxf(pm, v[j]);
                }
                const float m = fmaxf(st.m, pm);
                if (m == -KILN_INF) continue;
                float s = st.s * expf(st.m - m);
#pragma unroll
                for (int j = 0; j < V; ++j) s += expf(v[j] - m);
                st = {m, s};
            }
        }
    } else {
        for (int c = threadIdx.x; c < C; c += NT) {
            if (keep != nullptr) keep[c] = xr[c];
            const float v = to_float(xr[c]);
            const float m = fmaxf(st.m, v);
            if (m == -KILN_INF) continue;
            st = {m, st.s * expf(st.m - m) + expf(v - m)};
        }
    }
    __shared__ float sm[NT / 32], ss[NT / 32];
    return block_max_sum<NT>(st, sm, ss);
}

}  // namespace kiln
