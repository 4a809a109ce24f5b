// Multi-tensor AdamW, global gradient norm and in-place scaling: one launch covers every
// tensor of a dtype group (the paper's "Horizontal Tensor Fusion"). The host splits each
// tensor into fixed-size chunks and passes a chunk table (tensor id, first element), so
// every block gets the same amount of work whatever the tensor boundaries (chunk-based load
// balancing, no tail of one huge tensor on a few blocks). Tables are built once per set of
// tensors and stay on the device.
#include "common.cuh"

using namespace kiln;

constexpr int kMtThreads = 256;
constexpr int kMtUnroll = 4;

// ptrs[4 * t + {0,1,2,3}] = param, grad, exp_avg, exp_avg_sq of tensor t (exp_avg* in TP).
template <typename TP, typename TG>
__global__ void __launch_bounds__(kMtThreads) adamw_multi(const unsigned long long* __restrict__ ptrs,
                                                          const long long* __restrict__ sizes,
                                                          const float* __restrict__ weight_decays,
                                                          const int* __restrict__ chunk_tensor,
                                                          const long long* __restrict__ chunk_start,
                                                          long long chunk_size, float lr, float beta1,
                                                          float beta2, float eps, float step_size,
                                                          float bias_correction2_sqrt) {
    const int t = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long end = min(start + chunk_size, sizes[t]);
    TP* __restrict__ p = reinterpret_cast<TP*>(ptrs[4 * t + 0]);
    const TG* __restrict__ g = reinterpret_cast<const TG*>(ptrs[4 * t + 1]);
    TP* __restrict__ m = reinterpret_cast<TP*>(ptrs[4 * t + 2]);
    TP* __restrict__ v = reinterpret_cast<TP*>(ptrs[4 * t + 3]);
    const float decay = 1.0f - lr * weight_decays[t];
    for (long long base = start + threadIdx.x; base < end; base += (long long)kMtThreads * kMtUnroll) {
        float rp[kMtUnroll], rg[kMtUnroll], rm[kMtUnroll], rv[kMtUnroll];
#pragma unroll
        for (int u = 0; u < kMtUnroll; ++u) {
            const long long e = base + (long long)u * kMtThreads;
            if (e < end) {
                rp[u] = to_float(p[e]);
                rg[u] = to_float(g[e]);
                rm[u] = to_float(m[e]);
                rv[u] = to_float(v[e]);
            }
        }
#pragma unroll
        for (int u = 0; u < kMtUnroll; ++u) {
            const long long e = base + (long long)u * kMtThreads;
            if (e < end) {
                const float pp = rp[u] * decay;
                const float mm = rm[u] + (rg[u] - rm[u]) * (1.0f - beta1);
                const float vv = rv[u] * beta2 + rg[u] * rg[u] * (1.0f - beta2);
                const float denom = sqrtf(vv) / bias_correction2_sqrt + eps;
                p[e] = from_float<TP>(pp - step_size * (mm / denom));
                m[e] = from_float<TP>(mm);
                v[e] = from_float<TP>(vv);
            }
        }
    }
}

// partial[partial_offset + chunk] = sum of squares of the chunk (ptrs[t] = tensor t).
template <typename T>
__global__ void __launch_bounds__(kMtThreads) sumsq_multi(const unsigned long long* __restrict__ ptrs,
                                                          const long long* __restrict__ sizes,
                                                          const int* __restrict__ chunk_tensor,
                                                          const long long* __restrict__ chunk_start,
                                                          long long chunk_size, float* __restrict__ partial,
                                                          int partial_offset) {
    const int t = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long end = min(start + chunk_size, sizes[t]);
    const T* __restrict__ a = reinterpret_cast<const T*>(ptrs[t]);
    float s = 0.0f;
    for (long long base = start + threadIdx.x; base < end; base += (long long)kMtThreads * kMtUnroll) {
        float r[kMtUnroll];
#pragma unroll
        for (int u = 0; u < kMtUnroll; ++u) {
            const long long e = base + (long long)u * kMtThreads;
            r[u] = e < end ? to_float(a[e]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kMtUnroll; ++u) s += r[u] * r[u];
    }
    __shared__ float scratch[kMtThreads / 32];
    s = block_sum<kMtThreads>(s, scratch);
    if (threadIdx.x == 0) partial[partial_offset + blockIdx.x] = s;
}

// out[0] = sqrt(sum of partial[0:n]), one block of 1024 threads, fixed order.
__global__ void __launch_bounds__(1024) sumsq_finish(const float* __restrict__ partial, int n,
                                                     float* __restrict__ out) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += 1024) s += partial[i];
    __shared__ float scratch[32];
    s = block_sum<1024>(s, scratch);
    if (threadIdx.x == 0) out[0] = sqrtf(s);
}

// a *= factor[0] for every chunk of every tensor, in place.
template <typename T>
__global__ void __launch_bounds__(kMtThreads) scale_multi(const unsigned long long* __restrict__ ptrs,
                                                          const long long* __restrict__ sizes,
                                                          const int* __restrict__ chunk_tensor,
                                                          const long long* __restrict__ chunk_start,
                                                          long long chunk_size, const float* __restrict__ factor) {
    const int t = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long end = min(start + chunk_size, sizes[t]);
    T* __restrict__ a = reinterpret_cast<T*>(ptrs[t]);
    const float f = factor[0];
    for (long long e = start + threadIdx.x; e < end; e += kMtThreads) a[e] = from_float<T>(to_float(a[e]) * f);
}
