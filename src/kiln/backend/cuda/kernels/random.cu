// Counter-based random numbers (Philox-4x32-10, Salmon et al. 2011) for kiln's device
// generator: uniform and normal fills and dropout. Element group i (4 values) uses counter
// (offset + i, 0, 0) and the seed as key, so a stream is reproducible from (seed, offset) and
// the generator's state is two integers that a checkpoint can save.
#include "common.cuh"

using namespace kiln;

namespace {

struct U4 {
    unsigned x, y, z, w;
};

__device__ __forceinline__ U4 philox4x32_10(unsigned long long counter, unsigned long long seed) {
    U4 c{(unsigned)counter, (unsigned)(counter >> 32), 0u, 0u};
    unsigned k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = U4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

__device__ __forceinline__ float uniform01(unsigned u) { return (float)(u >> 8) * (1.0f / 16777216.0f); }

}  // namespace

template <typename T>
__global__ void philox_uniform(T* __restrict__ out, long long n, unsigned long long seed,
                               unsigned long long offset) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i >= n) return;
    const U4 r = philox4x32_10(offset + (unsigned long long)i, seed);
    const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (4 * i + j < n) out[4 * i + j] = from_float<T>(uniform01(u[j]));
}

template <typename T>
__global__ void philox_normal(T* __restrict__ out, long long n, unsigned long long seed,
                              unsigned long long offset) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i >= n) return;
    const U4 r = philox4x32_10(offset + (unsigned long long)i, seed);
    float z[4];
    // Box-Muller on two pairs; u1 in (0, 1] so the log is finite.
    const float u1a = ((float)(r.x >> 8) + 1.0f) * (1.0f / 16777216.0f), u2a = uniform01(r.y);
    const float u1b = ((float)(r.z >> 8) + 1.0f) * (1.0f / 16777216.0f), u2b = uniform01(r.w);
    const float ra = sqrtf(-2.0f * logf(u1a)), rb = sqrtf(-2.0f * logf(u1b));
    // The angle as sincospif's 2u (exact) in [0, 2): sincosf(2 pi u) carries a large-argument reduction
    // (Payne-Hanek, a 28-byte local array) that ptxas 13.0 leaves in a stack frame, and never takes it here.
    float sa, ca, sb, cb;
    sincospif(2.0f * u2a, &sa, &ca);
    sincospif(2.0f * u2b, &sb, &cb);
    z[0] = ra * ca;
    z[1] = ra * sa;
    z[2] = rb * cb;
    z[3] = rb * sb;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (4 * i + j < n) out[4 * i + j] = from_float<T>(z[j]);
}

// y = x * mask, mask = (u >= p) * scale in T (the backward is grad * mask).
template <typename T>
__global__ void dropout_fwd(const T* __restrict__ x, T* __restrict__ y, T* __restrict__ mask, long long n,
                            float p, float scale, unsigned long long seed, unsigned long long offset) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i >= n) return;
    const U4 r = philox4x32_10(offset + (unsigned long long)i, seed);
    const unsigned u[4] = {r.x, r.y, r.z, r.w};
    const float keep_value = to_float(from_float<T>(scale));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const long long e = 4 * i + j;
        if (e < n) {
            const float mv = uniform01(u[j]) >= p ? keep_value : 0.0f;
            mask[e] = from_float<T>(mv);
            y[e] = from_float<T>(to_float(x[e]) * mv);
        }
    }
}
