// sgemm_2_coalesced: the naive kernel with the thread indices swapped, so warps coalesce.
//
// The idea: a warp is 32 threads with consecutive threadIdx.x that issue each load together.
// When those 32 threads touch 32 consecutive floats (128 bytes), the hardware serves them
// with a few wide transactions; when they touch 32 scattered floats it needs 32. Here the
// fast index threadIdx.x walks ALONG a row of C (col = ... + threadIdx.x), so in each step
// of the k loop a warp reads B[k, col..col+31] (one 128-byte line), shares a single A[row, k]
// (a broadcast) and finally writes C[row, col..col+31] contiguously.
//
// Same FLOPs and the same 2K loads per thread as sgemm_1: only the ORDER in which threads
// touch memory changed, and the effective bandwidth rises by the transaction count saved.
// Every operand is still used once per load, so the kernel stays bandwidth-bound (L1/L2 hits
// help). Boehm measured 1987 GFLOP/s (8.5 % of cuBLAS), 6.4x kernel 1.
//
// One thread's view (block (bx, by), grid (ceil(N/bx), ceil(M/by))):
//     1. col = blockIdx.x * bx + threadIdx.x; row = blockIdx.y * by + threadIdx.y
//     2. if (row, col) lies outside C, do nothing
//     3. acc = sum_k A[row, k] * B[k, col]   (the warp's B loads are one line per k)
//     4. C[row, col] = alpha * acc + beta * C[row, col]
//
// Shapes (row-major, float32): A (M, K), B (K, N), C (M, N); any M, N, K >= 1; any block
// (bx a multiple of 32 to coalesce fully).
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (2MNK + 2MN), in whole lines.
// 64-bit offsets: row * K, k * N and row * N are formed in 64 bits (at64, unsigned), so
// matrices with more than 2^31 elements (M K, K N or M N > 2^31) index correctly; M, N, K
// themselves are ints (each < 2^31).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 2 (global memory coalescing).
// Next rung: sgemm_3_smem.cu (reuse each loaded value from shared memory).

// row * ld + col as a 64-bit offset from a 32 x 32 -> 64-bit unsigned multiply (one
// IMAD.WIDE.U32): a signed long long product costs registers (rung 4: 39 -> 48, a block
// fewer per SM). Every argument is >= 0.
__device__ __forceinline__ unsigned long long at64(int row, int ld, int col) {
    return (unsigned long long)(unsigned)row * (unsigned)ld + (unsigned)col;
}

extern "C" __global__ void sgemm_coalesced(int M, int N, int K, float alpha, const float* A,
                                           const float* B, float beta, float* C) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;  // fast index walks along a row
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row < M && col < N) {
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
            acc += A[at64(row, K, k)] * B[at64(k, N, col)];
        }
        C[at64(row, N, col)] = alpha * acc + beta * C[at64(row, N, col)];
    }
}
