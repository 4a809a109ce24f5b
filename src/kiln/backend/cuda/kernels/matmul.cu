// The linear layer's bias gradient, dbias[c] = the sum over rows of grad[r][c] (its GEMMs are
// cuBLASLt's, backend/cuda/matmul.py): the part step of column_sum.cuh over grad as stored, then
// column_sum_finish. Reads only: one pass over grad.
#include "column_sum.cuh"

template <typename T, bool kVec>
__global__ void column_sum_part(const T* __restrict__ a, float* __restrict__ partial, int rows, int C,
                                int rows_per_part) {
    kiln::column_sum_part_rows<T, kVec>(kiln::StoredElems<T>{a}, partial, rows, C, rows_per_part);
}
