// Multi-tensor AdamW, global gradient norm and in-place scaling: one launch covers every
// tensor of a dtype group (the paper's "Horizontal Tensor Fusion").
//
// A tensor list is one small device table: K pointers per tensor, the sizes, and
// block_start[T + 1], the first chunk (block) of each tensor. Block b finds its tensor by a
// binary search of block_start, so the host never builds a per-chunk table (that was a
// Python loop over ~7.7K chunks plus five uploads each time the gradient buffers moved,
// i.e. every step). Chunks never straddle tensors, so a block's loads are 16-byte vectors
// whenever the tensor's pointers are aligned, scalar otherwise.
//
// A parameter's kept copy in a compute dtype (a bf16 step's weights) is written from the updated
// fp32 value in the same pass, so no separate cast reads the weights again before the forward.
//
// Gradient clipping is fused into AdamW: given the device scalar of the global norm, each
// block computes min(1, max_norm / (norm + 1e-6)) (torch's coefficient; NaN propagates) and
// scales the gradient as it reads it. No host sync, no separate scale pass.
#include "common.cuh"

using namespace kiln;

constexpr int kMtThreads = KILN_MT_THREADS;  // backend/cuda/adamw.py THREADS

// The tensor that owns block b: the last t with block_start[t] <= b.
__device__ __forceinline__ int owner_tensor(const long long* __restrict__ block_start, int T, long long b) {
    int lo = 0, hi = T - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (block_start[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// torch.nn.utils.clip_grad_norm_'s coefficient; a NaN norm gives NaN (c > 1 is false).
__device__ __forceinline__ float clip_coef(const float* clip_norm, float max_norm) {
    if (clip_norm == nullptr) return 1.0f;
    const float c = max_norm / (clip_norm[0] + 1e-6f);
    return c > 1.0f ? 1.0f : c;
}

struct AdamArgs {
    float lr, beta1, beta2, eps, step_size, inv_bias_correction2_sqrt;
};

// One element of torch.optim.AdamW (decoupled decay), in fp32; g already clipped.
__device__ __forceinline__ void adam_elem(float& p, float g, float& m, float& v, float decay, const AdamArgs& a) {
    p *= decay;
    m += (g - m) * (1.0f - a.beta1);
    v = v * a.beta2 + g * g * (1.0f - a.beta2);
    const float denom = sqrtf(v) * a.inv_bias_correction2_sqrt + a.eps;
    p -= a.step_size * (m / denom);
}

// ptrs[5 t + {0,1,2,3,4}] = param, grad, exp_avg, exp_avg_sq (exp_avg* in TP) and the kept copy
// (TC, round to nearest even; 0: the tensor has none) of tensor t.
template <typename TP, typename TG, typename TC>
__global__ void __launch_bounds__(kMtThreads) adamw_multi(const unsigned long long* __restrict__ ptrs,
                                                          const long long* __restrict__ sizes,
                                                          const long long* __restrict__ block_start, int T,
                                                          const float* __restrict__ weight_decays,
                                                          long long chunk_size, const float* clip_norm,
                                                          float max_norm, float lr, float beta1, float beta2,
                                                          float eps, float step_size,
                                                          float inv_bias_correction2_sqrt,
                                                          const float* __restrict__ hyper) {
    if (hyper != nullptr) {  // a replayed CUDA graph: this step's scalars, written before the replay
        lr = hyper[0];
        step_size = hyper[1];
        inv_bias_correction2_sqrt = hyper[2];
    }
    const int t = owner_tensor(block_start, T, blockIdx.x);
    const long long start = (blockIdx.x - block_start[t]) * chunk_size;
    const long long end = min(start + chunk_size, sizes[t]);
    TP* __restrict__ p = reinterpret_cast<TP*>(ptrs[5 * t + 0]);
    const TG* __restrict__ g = reinterpret_cast<const TG*>(ptrs[5 * t + 1]);
    TP* __restrict__ m = reinterpret_cast<TP*>(ptrs[5 * t + 2]);
    TP* __restrict__ v = reinterpret_cast<TP*>(ptrs[5 * t + 3]);
    TC* __restrict__ c = reinterpret_cast<TC*>(ptrs[5 * t + 4]);
    const AdamArgs a{lr, beta1, beta2, eps, step_size, inv_bias_correction2_sqrt};
    const float decay = 1.0f - lr * weight_decays[t];
    const float coef = clip_coef(clip_norm, max_norm);
    long long tail = start;
    if (vec4_aligned(p) && vec4_aligned(g) && vec4_aligned(m) && vec4_aligned(v) && (c == nullptr || vec4_aligned(c))) {
        const long long vend = start + ((end - start) & ~3ll);
        for (long long e = start + 4ll * threadIdx.x; e < vend; e += 4ll * kMtThreads) {
            float4 rp = load_f4(p + e), rm = load_f4(m + e), rv = load_f4(v + e);
            const float4 rg = load_f4(g + e);
            adam_elem(rp.x, rg.x * coef, rm.x, rv.x, decay, a);
            adam_elem(rp.y, rg.y * coef, rm.y, rv.y, decay, a);
            adam_elem(rp.z, rg.z * coef, rm.z, rv.z, decay, a);
            adam_elem(rp.w, rg.w * coef, rm.w, rv.w, decay, a);
            store_f4(p + e, rp);
            store_f4(m + e, rm);
            store_f4(v + e, rv);
            if (c != nullptr) store_f4(c + e, rp);
        }
        tail = vend;
    }
    for (long long e = tail + threadIdx.x; e < end; e += kMtThreads) {
        float rp = to_float(p[e]), rm = to_float(m[e]), rv = to_float(v[e]);
        adam_elem(rp, to_float(g[e]) * coef, rm, rv, decay, a);
        p[e] = from_float<TP>(rp);
        m[e] = from_float<TP>(rm);
        v[e] = from_float<TP>(rv);
        if (c != nullptr) c[e] = from_float<TC>(to_float(p[e]));
    }
}

// Sum of squares of every chunk into partial[partial_offset + chunk]; the block that finishes
// last among all `total_blocks` blocks of this and earlier launches (counted in *counter, which
// it resets to 0) sums partial[0:n_partial] in a fixed order and writes sqrt into out[0].
// Deterministic: the partials and their final order do not depend on block timing.
template <typename T>
__global__ void __launch_bounds__(kMtThreads) sumsq_multi(const unsigned long long* __restrict__ ptrs,
                                                          const long long* __restrict__ sizes,
                                                          const long long* __restrict__ block_start, int T_,
                                                          long long chunk_size, float* __restrict__ partial,
                                                          int partial_offset, int n_partial,
                                                          unsigned int* __restrict__ counter, unsigned int total_blocks,
                                                          float* __restrict__ out) {
    const int t = owner_tensor(block_start, T_, blockIdx.x);
    const long long start = (blockIdx.x - block_start[t]) * chunk_size;
    const long long end = min(start + chunk_size, sizes[t]);
    const T* __restrict__ a = reinterpret_cast<const T*>(ptrs[t]);
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    long long tail = start;
    if (vec4_aligned(a)) {
        const long long vend = start + ((end - start) & ~3ll);
        constexpr long long kStep = 4ll * kMtThreads;
        long long e = start + 4ll * threadIdx.x;
        for (; e + 3 * kStep < vend; e += 4 * kStep) {  // four independent 16-byte loads in flight
            const float4 x0 = load_f4(a + e), x1 = load_f4(a + e + kStep), x2 = load_f4(a + e + 2 * kStep),
                         x3 = load_f4(a + e + 3 * kStep);
            s0 += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w;
            s1 += x1.x * x1.x + x1.y * x1.y + x1.z * x1.z + x1.w * x1.w;
            s2 += x2.x * x2.x + x2.y * x2.y + x2.z * x2.z + x2.w * x2.w;
            s3 += x3.x * x3.x + x3.y * x3.y + x3.z * x3.z + x3.w * x3.w;
        }
        for (; e < vend; e += kStep) {
            const float4 x = load_f4(a + e);
            s0 += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        }
        tail = vend;
    }
    for (long long e = tail + threadIdx.x; e < end; e += kMtThreads) {
        const float x = to_float(a[e]);
        s1 += x * x;
    }
    __shared__ float scratch[kMtThreads / 32];
    __shared__ bool is_last;
    const float s = block_sum<kMtThreads>((s0 + s1) + (s2 + s3), scratch);
    if (threadIdx.x == 0) {
        partial[partial_offset + blockIdx.x] = s;
        __threadfence();
        is_last = atomicAdd(counter, 1u) == total_blocks - 1u;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    float f = 0.0f;
    for (int i = threadIdx.x; i < n_partial; i += kMtThreads) f += __ldcg(partial + i);
    f = block_sum<kMtThreads>(f, scratch);
    if (threadIdx.x == 0) {
        out[0] = sqrtf(f);
        *counter = 0u;
    }
}

// out[0] = sqrt(sum of partial[0:n]), one block of 1024 threads, fixed order (grad_norm when
// no gradient has a kernel dtype: its partials come from CuPy dot products).
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
                                                          const long long* __restrict__ block_start, int T_,
                                                          long long chunk_size, const float* __restrict__ factor) {
    const int t = owner_tensor(block_start, T_, blockIdx.x);
    const long long start = (blockIdx.x - block_start[t]) * chunk_size;
    const long long end = min(start + chunk_size, sizes[t]);
    T* __restrict__ a = reinterpret_cast<T*>(ptrs[t]);
    const float f = factor[0];
    long long tail = start;
    if (vec4_aligned(a)) {
        const long long vend = start + ((end - start) & ~3ll);
        constexpr long long kStep = 4ll * kMtThreads;
        long long e = start + 4ll * threadIdx.x;
        for (; e + kStep < vend; e += 2 * kStep) {  // two independent 16-byte loads in flight
            float4 x = load_f4(a + e), y = load_f4(a + e + kStep);
            x.x *= f; x.y *= f; x.z *= f; x.w *= f;
            y.x *= f; y.y *= f; y.z *= f; y.w *= f;
            store_f4(a + e, x);
            store_f4(a + e + kStep, y);
        }
        for (; e < vend; e += kStep) {
            float4 x = load_f4(a + e);
            x.x *= f; x.y *= f; x.z *= f; x.w *= f;
            store_f4(a + e, x);
        }
        tail = vend;
    }
    for (long long e = tail + threadIdx.x; e < end; e += kMtThreads) a[e] = from_float<T>(to_float(a[e]) * f);
}

// hyper[0..2] = (lr, step size, 1 / sqrt(bias correction 2)) for adamw_multi in a captured graph.
__global__ void adamw_set_hyper(float* hyper, float lr, float step_size, float inv_bc2_sqrt) {
    hyper[0] = lr;
    hyper[1] = step_size;
    hyper[2] = inv_bc2_sqrt;
}
