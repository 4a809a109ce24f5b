// Softmax cross-entropy fused with the softmax, from logits[N, V] read in their own dtype.
//
// Forward: one block per row, one online (max, sum) pass over the logits gives the row's
// log-sum-exp; the row's loss is lse - logit[target] (0 for ignore_index, NaN for a target
// outside [0, V): no range check or host sync on the device). `cross_entropy_mean` then sums
// losses and counts valid rows in a fixed order, on the device.
// Backward: `cross_entropy_count` turns the upstream grad into grad / count on the device,
// and one pass per row writes dlogits = (exp(x - lse) - onehot) * grad / count.
#include "common.cuh"

using namespace kiln;

constexpr int kCeThreads = KILN_CE_THREADS;  // threads per row (cross_entropy.py)

template <typename T, typename I>
__global__ void __launch_bounds__(kCeThreads) cross_entropy_fwd(const T* __restrict__ logits,
                                                                const I* __restrict__ targets,
                                                                float* __restrict__ lse_out,
                                                                float* __restrict__ rows, int n, int V,
                                                                long long ignore_index) {
    constexpr int P = Pack<T>::N;
    const int row = blockIdx.x;
    const T* xr = logits + (long long)row * V;
    const bool vec = V % P == 0 && aligned16(logits);
    const MaxSum st = row_max_sum<kCeThreads>(xr, V, vec);
    if (threadIdx.x == 0) {
        const float lse = st.m + logf(st.s);
        lse_out[row] = lse;
        const long long t = (long long)targets[row];
        float loss = 0.0f, valid = 0.0f;
        if (t != ignore_index) {
            valid = 1.0f;
            loss = (t >= 0 && t < V) ? lse - to_float(xr[t]) : KILN_NAN;
        }
        rows[row] = loss;
        rows[n + row] = valid;
    }
}

// out[0] = sum(rows[0:n]) / sum(rows[n:2n]) with one block of 1024 threads, fixed order.
__global__ void __launch_bounds__(1024) cross_entropy_mean(const float* __restrict__ rows, int n,
                                                           float* __restrict__ out) {
    float s = 0.0f, c = 0.0f;
    for (int i = threadIdx.x; i < n; i += 1024) {
        s += rows[i];
        c += rows[n + i];
    }
    __shared__ float scratch[32];
    s = block_sum<1024>(s, scratch);
    c = block_sum<1024>(c, scratch);
    if (threadIdx.x == 0) out[0] = s / c;
}

// scale[0] = grad[0] / (number of targets != ignore_index), one block of 1024 threads.
template <typename I>
__global__ void __launch_bounds__(1024) cross_entropy_count(const I* __restrict__ targets, int n,
                                                            long long ignore_index,
                                                            const float* __restrict__ grad,
                                                            float* __restrict__ scale) {
    float c = 0.0f;
    for (int i = threadIdx.x; i < n; i += 1024) c += ((long long)targets[i] != ignore_index) ? 1.0f : 0.0f;
    __shared__ float scratch[32];
    c = block_sum<1024>(c, scratch);
    if (threadIdx.x == 0) scale[0] = grad[0] / c;
}

// dst = (exp(src - lse) - onehot(t)) * sc over one row of V logits (zero where ignored): src is the
// row in global memory, or its copy in shared memory; dst may be src (in place). Thread i takes the
// packs (elements) i, i + kCeThreads, ..., the stride row_max_sum read them with.
template <typename T>
__device__ __forceinline__ void write_dlogits(const T* src, T* dst, int V, bool vec, long long t, float lse,
                                              float sc, bool ignored) {
    constexpr int P = Pack<T>::N;
    if (vec) {
        for (int p = threadIdx.x; p < V / P; p += kCeThreads) {
            const Pack<T> a = load_pack(src + p * P);
            Pack<T> o;
#pragma unroll
            for (int j = 0; j < P; ++j) {
                const int c = p * P + j;
                const float prob = expf(to_float(a.v[j]) - lse) - (c == t ? 1.0f : 0.0f);
                o.v[j] = from_float<T>(ignored ? 0.0f : prob * sc);
            }
            store_pack(dst + p * P, o);
        }
    } else {
        for (int c = threadIdx.x; c < V; c += kCeThreads) {
            const float prob = expf(to_float(src[c]) - lse) - (c == t ? 1.0f : 0.0f);
            dst[c] = from_float<T>(ignored ? 0.0f : prob * sc);
        }
    }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kCeThreads) cross_entropy_bwd(const T* __restrict__ logits,
                                                                const I* __restrict__ targets,
                                                                const float* __restrict__ lse,
                                                                const float* __restrict__ scale,
                                                                T* __restrict__ dlogits, int V,
                                                                long long ignore_index) {
    constexpr int P = Pack<T>::N;
    const int row = blockIdx.x;
    const long long off = (long long)row * V;
    const long long t = (long long)targets[row];
    const bool ignored = t == ignore_index;
    const bool vec = V % P == 0 && aligned16(logits) && aligned16(dlogits);
    write_dlogits(logits + off, dlogits + off, V, vec, t, lse[row], ignored ? 0.0f : scale[0], ignored);
}

// Forward and backward of one chunk of rows in one launch, in place: a block per row finds the
// row's log-sum-exp (one pass), writes its loss and validity, then overwrites the logits with
// dlogits = (exp(x - lse) - onehot) * scale[0] (scale = 1 / count, computed before the chunks).
// The fused LM head (lm_head.py) runs it on each chunk of logits, which are never kept whole.
// Launched with V * sizeof(T) bytes of dynamic shared memory, the block keeps its row there from
// the first pass, and the second reads it back instead of from global memory: two passes over the
// logits (read, write) instead of three. With less, it reads the row twice.
template <typename T, typename I>
__global__ void __launch_bounds__(kCeThreads) cross_entropy_fused(T* __restrict__ logits,
                                                                  const I* __restrict__ targets,
                                                                  float* __restrict__ loss_rows,
                                                                  float* __restrict__ valid_rows,
                                                                  const float* __restrict__ scale, int V,
                                                                  long long ignore_index) {
    extern __shared__ __align__(16) unsigned char ce_kept_row[];
    constexpr int P = Pack<T>::N;
    const int row = blockIdx.x;
    T* xr = logits + (long long)row * V;
    const long long t = (long long)targets[row];
    const bool ignored = t == ignore_index;
    const bool in_range = t >= 0 && t < V;
    unsigned shared_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(shared_bytes));
    T* kept = shared_bytes >= (unsigned long long)V * sizeof(T) ? reinterpret_cast<T*>(ce_kept_row) : nullptr;
    // the target's logit is read before block_max_sum's barriers, so before any thread overwrites it
    float xt = 0.0f;
    if (threadIdx.x == 0 && !ignored && in_range) xt = to_float(xr[t]);
    const bool vec = V % P == 0 && aligned16(logits);
    const MaxSum st = row_max_sum<kCeThreads>(xr, V, vec, kept);
    const float lse = st.m + logf(st.s);
    if (threadIdx.x == 0) {
        loss_rows[row] = ignored ? 0.0f : (in_range ? lse - xt : KILN_NAN);
        valid_rows[row] = ignored ? 0.0f : 1.0f;
    }
    const float sc = ignored ? 0.0f : scale[0];
    if (kept != nullptr) {
        write_dlogits(reinterpret_cast<const T*>(ce_kept_row), xr, V, vec, t, lse, sc, ignored);
    } else {
        write_dlogits(static_cast<const T*>(xr), xr, V, vec, t, lse, sc, ignored);
    }
}
