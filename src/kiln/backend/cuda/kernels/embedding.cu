// Embedding lookup and its deterministic backward.
//
// Forward: one warp per output row copies weight[idx] (16-byte packs when aligned); an index
// outside [0, V) gives a row of NaN instead of an out-of-bounds read (no host-side check).
// Backward (deterministic, no float atomics, no sort library): a stable counting sort of the
// n positions by index in kiln's own kernels, then fixed-length segments of the sorted order
// summed one block each, and runs that cross segments combined in segment order. Every
// dweight row is the sum of its grad rows in position order up to the fixed segmentation,
// whatever the timing. `embedding_bwd<T, I>` is one kernel launched once per phase:
//   0 rank:    per tile of kEmbTile positions, each position's rank among equal indices
//              before it in the tile, and the tile's count of every index (tile_count)
//   1 prefix:  per index v, the exclusive prefix of its counts over tiles, made relative to
//              its kEmbThreads-index block by a block scan; the block's total in block_total
//   2 scatter: slot = offset of v's block + prefix + rank (stable); sorted_pos, sorted_key
//   3 segment: one block per kEmbSeg sorted slots sums each run of equal keys, writing the
//              row directly or, for a run that crosses the segment's edge, a partial row
//   4 combine: the segment where a crossing run starts adds the partials of the segments it
//              crosses, in order, and writes the row
// An index outside [0, V) is counted as V and dropped. dweight must be zero on entry, or, with
// `accumulate`, hold a gradient the rows' sums are added to (a tied weight's: GPT-2's LM head writes
// wte's gradient first); every row of a present index is written once, so either way is deterministic.
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

constexpr int kEmbThreads = KILN_EMB_THREADS;  // the constants of this block come from embedding.py
constexpr int kEmbTile = KILN_EMB_TILE;      // positions per rank tile (phase 0)
constexpr int kEmbSeg = KILN_EMB_SEG;     // sorted slots per segment (phases 3, 4)
constexpr int kEmbMaxVBlocks = KILN_EMB_MAX_V_BLOCKS; // phase-1 blocks (V + 1 <= 4096 * 256) whose offsets sit in shared memory

// Phase-3 codes for the slot that ends a run (else kEmbNone); a code >= 0 is a dweight row.
constexpr int kEmbNone = -1, kEmbHead = -2, kEmbTail = -3, kEmbDrop = -4;

template <typename I>
__device__ __forceinline__ int emb_key(const I* idx, int i, long long V) {
    const long long t = (long long)idx[i];
    return (t < 0 || t >= V) ? (int)V : (int)t;
}

// Exclusive scan of one int per thread over the block (kEmbThreads threads); *total = the sum.
__device__ __forceinline__ int block_exclusive_scan(int x, int* scratch, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inc = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    int before = 0, sum = 0;
#pragma unroll
    for (int w = 0; w < kEmbThreads / 32; ++w) {
        const int v = scratch[w];
        before += w < warp ? v : 0;
        sum += v;
    }
    __syncthreads();
    *total = sum;
    return before + inc - x;
}

// Segment s covers sorted slots [s * kEmbSeg, min(that + kEmbSeg, n)).
struct EmbSeg {
    int begin, end, first_key, last_key;
    bool head_cont, tail_cont;  // its first run began in the previous segment / last run goes on
};

__device__ __forceinline__ EmbSeg emb_segment(const int* sorted_key, int s, int n) {
    EmbSeg g;
    g.begin = s * kEmbSeg;
    g.end = min(g.begin + kEmbSeg, n);
    g.first_key = sorted_key[g.begin];
    g.last_key = sorted_key[g.end - 1];
    g.head_cont = g.begin > 0 && sorted_key[g.begin - 1] == g.first_key;
    g.tail_cont = g.end < n && sorted_key[g.end] == g.last_key;
    return g;
}

__device__ __forceinline__ float4 f4_add(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

template <typename T>
__device__ __forceinline__ void emb_emit4(int code, float4 acc, T* dweight, float* seg_partial, int C, int c,
                                          bool accumulate) {
    if (code >= 0) {
        T* const row = dweight + (long long)code * C + c;
        store_f4(row, accumulate ? f4_add(load_f4(row), acc) : acc);
    } else if (code == kEmbHead) store_f4(seg_partial + c, acc);
    else if (code == kEmbTail) store_f4(seg_partial + C + c, acc);
}

template <typename T>
__device__ __forceinline__ void emb_emit1(int code, float acc, T* dweight, float* seg_partial, int C, int c,
                                          bool accumulate) {
    if (code >= 0) {
        T* const row = dweight + (long long)code * C + c;
        *row = from_float<T>(accumulate ? to_float(*row) + acc : acc);
    } else if (code == kEmbHead) seg_partial[c] = acc;
    else if (code == kEmbTail) seg_partial[C + c] = acc;
}

template <typename T, typename I>
__global__ void __launch_bounds__(kEmbThreads) embedding_bwd(int phase, const T* __restrict__ grad,
                                                             const I* __restrict__ idx, T* __restrict__ dweight,
                                                             int n, int C, long long V,
                                                             int* __restrict__ tile_count, int* __restrict__ rank,
                                                             int* __restrict__ block_total, int nblocks_v,
                                                             int* __restrict__ sorted_pos, int* __restrict__ sorted_key,
                                                             float* __restrict__ partial, int accumulate) {
    const long long V1 = V + 1;  // keys 0..V; V stands for every out-of-range index
    __shared__ int sh[kEmbMaxVBlocks];
    __shared__ int scratch[kEmbThreads / 32];
    if (phase == 0) {  // rank within the tile and the tile's counts
        const int base = blockIdx.x * kEmbTile;
        const int len = min(kEmbTile, n - base);
        int* tc = tile_count + (long long)blockIdx.x * V1;
        for (long long v = threadIdx.x; v < V1; v += kEmbThreads) tc[v] = 0;
        for (int j = threadIdx.x; j < len; j += kEmbThreads) sh[j] = emb_key(idx, base + j, V);
        __syncthreads();
        for (int i = threadIdx.x; i < len; i += kEmbThreads) {
            const int k = sh[i];
            int before = 0, count = 0;
            for (int j = 0; j < len; ++j) {
                const int eq = sh[j] == k;
                count += eq;
                before += eq & (j < i);
            }
            rank[base + i] = before;
            if (before == 0) tc[k] = count;  // the tile's first occurrence writes the count
        }
    } else if (phase == 1) {  // prefix over tiles, then over the block's keys
        const int ntiles = (n + kEmbTile - 1) / kEmbTile;
        const long long v = (long long)blockIdx.x * kEmbThreads + threadIdx.x;
        int run = 0;
        if (v < V1) {
            for (int t = 0; t < ntiles; ++t) {
                const int c = tile_count[t * V1 + v];
                tile_count[t * V1 + v] = run;
                run += c;
            }
        }
        int total;
        const int before = block_exclusive_scan(run, scratch, &total);
        if (v < V1) {
            for (int t = 0; t < ntiles; ++t) tile_count[t * V1 + v] += before;
        }
        if (threadIdx.x == 0) block_total[blockIdx.x] = total;
    } else if (phase == 2) {  // stable scatter into sorted order
        int carry = 0;
        for (int b0 = 0; b0 < nblocks_v; b0 += kEmbThreads) {
            const int b = b0 + threadIdx.x;
            int total;
            const int ex = block_exclusive_scan(b < nblocks_v ? block_total[b] : 0, scratch, &total);
            if (b < nblocks_v) sh[b] = carry + ex;
            carry += total;
        }
        __syncthreads();
        const int i = blockIdx.x * kEmbThreads + threadIdx.x;
        if (i >= n) return;
        const int k = emb_key(idx, i, V);
        const int slot = sh[k / kEmbThreads] + tile_count[(long long)(i / kEmbTile) * V1 + k] + rank[i];
        sorted_pos[slot] = i;
        sorted_key[slot] = k;
    } else if (phase == 3) {  // sum the runs of one segment
        const EmbSeg g = emb_segment(sorted_key, blockIdx.x, n);
        const int len = g.end - g.begin;
        int* spos = sh;
        int* scode = sh + kEmbSeg;
        if (threadIdx.x < len) {
            const int j = g.begin + threadIdx.x;
            const int k = sorted_key[j];
            spos[threadIdx.x] = sorted_pos[j];
            const bool run_end = threadIdx.x == len - 1 || sorted_key[j + 1] != k;
            int code = kEmbNone;
            if (run_end) {
                if (k == g.first_key && g.head_cont) code = kEmbHead;
                else if (k == g.last_key && g.tail_cont) code = kEmbTail;
                else if (k == (int)V) code = kEmbDrop;
                else code = k;
            }
            scode[threadIdx.x] = code;
        }
        __syncthreads();
        float* seg_partial = partial + (long long)blockIdx.x * 2 * C;
        if (C % 4 == 0 && vec4_aligned(grad) && vec4_aligned(dweight)) {
            for (int c = 4 * threadIdx.x; c < C; c += 4 * kEmbThreads) {
                float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (int j0 = 0; j0 < len; j0 += 4) {
                    float4 x[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u)
                        x[u] = j0 + u < len ? load_f4(grad + (long long)spos[j0 + u] * C + c)
                                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        if (j0 + u < len) {
                            acc = f4_add(acc, x[u]);
                            const int code = scode[j0 + u];
                            if (code != kEmbNone) {
                                emb_emit4(code, acc, dweight, seg_partial, C, c, accumulate);
                                acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                            }
                        }
                    }
                }
            }
        } else {
            for (int c = threadIdx.x; c < C; c += kEmbThreads) {
                float acc = 0.0f;
                for (int j0 = 0; j0 < len; j0 += 4) {
                    float x[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u)
                        x[u] = j0 + u < len ? to_float(grad[(long long)spos[j0 + u] * C + c]) : 0.0f;
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        if (j0 + u < len) {
                            acc += x[u];
                            const int code = scode[j0 + u];
                            if (code != kEmbNone) {
                                emb_emit1(code, acc, dweight, seg_partial, C, c, accumulate);
                                acc = 0.0f;
                            }
                        }
                    }
                }
            }
        }
    } else {  // phase 4: runs that cross segments, combined where they start
        const EmbSeg g = emb_segment(sorted_key, blockIdx.x, n);
        const bool single = g.first_key == g.last_key;
        if (!g.tail_cont || (single && g.head_cont) || g.last_key == (int)V) return;
        const int key = g.last_key;
        if (threadIdx.x == 0) {  // the run's last slot: binary search for the first larger key
            int lo = g.end, hi = n;
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (sorted_key[mid] <= key) lo = mid + 1;
                else hi = mid;
            }
            sh[0] = (lo - 1) / kEmbSeg;
        }
        __syncthreads();
        const int last = sh[0];
        T* row = dweight + (long long)key * C;
        const float* tail = partial + (long long)blockIdx.x * 2 * C + C;
        for (int c = threadIdx.x; c < C; c += kEmbThreads) {
            float acc = tail[c];
            for (int t = blockIdx.x + 1; t <= last; ++t) acc += partial[(long long)t * 2 * C + c];
            row[c] = from_float<T>(accumulate ? to_float(row[c]) + acc : acc);
        }
    }
}
