// sgemm_1_naive: C = alpha * A @ B + beta * C, one thread per element of C, straight from DRAM.
//
// The idea: the textbook triple loop with the two outer loops turned into threads. Thread
// (x, y) owns C[row, col] and walks k = 0..K-1 reading A[row, k] and B[k, col] from global
// memory. Every operand comes from DRAM (or L2 if lucky) and is used once: the arithmetic
// intensity is 2 FLOPs per 8 bytes loaded, whatever the matrix size.
//
// What is wrong with it (and what sgemm_2 fixes): threadIdx.x is the FAST index of a warp,
// and here it walks DOWN a column of C (row = ... + threadIdx.x). The 32 threads of a warp
// read A[row..row+31, k], 32 addresses K*4 bytes apart, and write C 32 rows apart: every
// access of the warp is split into 32 separate memory transactions (uncoalesced). Only
// B[k, col] is shared (a broadcast). Boehm measured 309 GFLOP/s, 1.3 % of cuBLAS.
//
// One thread's view (block (bx, by), grid (ceil(M/bx), ceil(N/by))):
//     1. row = blockIdx.x * bx + threadIdx.x; col = blockIdx.y * by + threadIdx.y
//     2. if (row, col) lies outside C (the last blocks overhang), do nothing
//     3. acc = sum_k A[row, k] * B[k, col]   (2K global loads, 2K FLOPs)
//     4. C[row, col] = alpha * acc + beta * C[row, col]
//
// Shapes (row-major, float32): A (M, K), B (K, N), C (M, N); any M, N, K >= 1; any block.
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued by this kernel 4 (2MNK + 2MN).
// 64-bit offsets: row * K, k * N and row * N are formed in 64 bits (at64, unsigned), so
// matrices with more than 2^31 elements (M K, K N or M N > 2^31) index correctly; M, N, K
// themselves are ints (each < 2^31).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 1 (A6000, 4096^3: 309 GFLOP/s).
// Next rung: sgemm_2_coalesced.cu (swap the thread indices).

// row * ld + col as a 64-bit offset from a 32 x 32 -> 64-bit unsigned multiply (one
// IMAD.WIDE.U32): a signed long long product costs registers (rung 4: 39 -> 48, a block
// fewer per SM). Every argument is >= 0.
__device__ __forceinline__ unsigned long long at64(int row, int ld, int col) {
    return (unsigned long long)(unsigned)row * (unsigned)ld + (unsigned)col;
}

extern "C" __global__ void sgemm_naive(int M, int N, int K, float alpha, const float* A,
                                       const float* B, float beta, float* C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;  // fast index walks down a column
    const int col = blockIdx.y * blockDim.y + threadIdx.y;
    if (row < M && col < N) {
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
            acc += A[at64(row, K, k)] * B[at64(k, N, col)];
        }
        C[at64(row, N, col)] = alpha * acc + beta * C[at64(row, N, col)];
    }
}
