// CPU emulation of the CUDA features the fp32 attention kernels use: one std::thread per CUDA
// thread, static locals as __shared__, std::barrier for __syncthreads/__syncwarp, shuffles
// through a per-warp exchange array, cp.async either at issue (mode 0), at the wait (mode 1) or
// at a random one of the two (mode 2).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
#define KILN_INF INFINITY
using std::min;
using std::max;

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

constexpr int kMaxWarps = 4;
inline std::barrier<>* g_block_bar;
inline std::barrier<>* g_warp_bar[kMaxWarps];
inline float g_shfl[kMaxWarps][32];
inline int g_mode = 0;
inline long g_align_errors = 0;

inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_shfl[w][l] = v;
    __syncwarp();
    const float r = g_shfl[w][l ^ o];
    __syncwarp();
    return r;
}

namespace kiln {
inline float to_float(float x) { return x; }
template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
}  // namespace kiln
using namespace kiln;

constexpr int kAttnThreads = 128;
#define KILN_LAYOUT(p) long long p##_sb, long long p##_sh, long long p##_st
inline long long head_offset(int bh, int n_h, long long sb, long long sh) {
    return (long long)(bh / n_h) * sb + (long long)(bh % n_h) * sh;
}

using u32 = uintptr_t;  // a plain pointer here
inline u32 smem_addr(const void* p) { return (u32)p; }
struct Copy { void* dst; const void* src; int n; bool ok; };
inline thread_local std::vector<std::vector<Copy>> t_pending;
inline thread_local std::vector<Copy> t_open;
inline thread_local std::mt19937 t_rng;
inline void do_copy(const Copy& c) {
    if (((uintptr_t)c.dst % c.n) || (c.ok && ((uintptr_t)c.src % c.n))) g_align_errors++;
    if (c.ok) std::memcpy(c.dst, c.src, c.n); else std::memset(c.dst, 0, c.n);
}
inline void cp_async_n(u32 dst, const void* src, bool ok, int n) {
    Copy c{(void*)dst, src, n, ok};
    const bool now = g_mode == 0 || (g_mode == 2 && (t_rng() & 1));
    if (now) do_copy(c); else t_open.push_back(c);
}
inline void cp_async16(u32 dst, const void* src, bool ok) { cp_async_n(dst, src, ok, 16); }
inline void cp_async4(u32 dst, const void* src, bool ok) { cp_async_n(dst, src, ok, 4); }
inline void cp_async_commit() { t_pending.push_back(std::move(t_open)); t_open.clear(); }
template <int N> inline void cp_async_wait_group() {
    while ((int)t_pending.size() > N) {
        for (auto& c : t_pending.front()) do_copy(c);
        t_pending.erase(t_pending.begin());
    }
}
inline void cp_async_wait_all() { cp_async_wait_group<0>(); }

// Runs body() for every block of grid, blocks one after another (x fastest), threads in parallel.
template <class F> void launch(dim3 grid, int threads, F body, unsigned seed = 1) {
    gridDim = grid;
    blockDim = dim3{(unsigned)threads, 1, 1};
    std::barrier<> bar(threads);
    std::vector<std::barrier<>*> wb;
    for (int w = 0; w < threads / 32; ++w) g_warp_bar[w] = new std::barrier<>(32);
    g_block_bar = &bar;
    std::vector<std::thread> ts;
    long leftovers = 0;
    for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
            threadIdx = dim3{(unsigned)t, 0, 0};
            t_rng.seed(seed * 7919u + t);
            for (unsigned by = 0; by < grid.y; ++by)
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    blockIdx = dim3{bx, by, 0};
                    body();
                    if (!t_open.empty() || !t_pending.empty()) __atomic_add_fetch(&leftovers, 1, __ATOMIC_RELAXED);
                    t_open.clear();
                    t_pending.clear();
                    bar.arrive_and_wait();  // the block's shared memory is reused by the next one
                }
        });
    for (auto& th : ts) th.join();
    for (int w = 0; w < threads / 32; ++w) delete g_warp_bar[w];
    if (leftovers) std::fprintf(stderr, "warning: %ld thread-blocks ended with cp.async in flight\n", leftovers);
}
