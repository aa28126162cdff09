// sgemm_3_smem: shared-memory tiling; each value loaded from DRAM is reused TILE times.
//
// The idea: the TILE x TILE threads of a block compute a TILE x TILE tile of C, and all of
// them need the same TILE rows of A and TILE columns of B. So the block walks K in steps of
// TILE: each thread copies ONE element of A's tile and ONE of B's tile from global memory
// into shared memory (on-chip, ~100x the bandwidth of DRAM), the block waits at a barrier,
// and then every thread reads TILE values of each tile from shared memory. Global loads drop
// from 2K to 2K/TILE per thread: the intensity against DRAM rises from 1/4 to TILE/4 FLOP/B.
//
// Two barriers per step: the first so that no thread reads a tile before all of it is
// written, the second so that no thread overwrites the tile while a slower one still reads
// it (remove either and the emulator's ThreadSanitizer build reports a race). Boehm measured
// 2980 GFLOP/s (12.8 % of cuBLAS) at TILE 32: now shared-memory loads, not DRAM, bound the
// loop (two LDS per FMA), which the register-blocking rungs attack next.
//
// One thread's view (block (TILE, TILE), grid (ceil(N/TILE), ceil(M/TILE))):
//     1. (ty, tx) = threadIdx; row = blockIdx.y * TILE + ty; col = blockIdx.x * TILE + tx
//     2. for k0 = 0, TILE, 2 TILE, ... < K:
//        a. As[ty][tx] = A[row, k0 + tx], Bs[ty][tx] = B[k0 + ty, col]   (0 outside A, B)
//        b. __syncthreads()
//        c. acc += sum_k As[ty][k] * Bs[k][tx]                           (2 TILE LDS)
//        d. __syncthreads()
//     3. C[row, col] = alpha * acc + beta * C[row, col]                   (if inside C)
//
// Shapes (row-major, float32): A (M, K), B (K, N), C (M, N); any M, N, K >= 1 (the zero
// padding of overhanging tiles adds nothing to acc). Shared memory: 2 TILE^2 * 4 bytes.
// Kernels: sgemm_smem_8, sgemm_smem_16 (emulator-sized blocks), sgemm_smem_32 (Boehm's).
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (2MNK / TILE + 2MN).
// Bank conflicts: none, so no padding. A warp is 32 / TILE whole rows ty of the block; its
// As[ty][k] reads are 32 / TILE addresses TILE words apart (different banks; one address
// per row, a broadcast), its Bs[k][tx] reads and both stores are consecutive words.
// 64-bit offsets: row * K, k * N and row * N are formed in 64 bits (at64, unsigned), so
// matrices with more than 2^31 elements (M K, K N or M N > 2^31) index correctly; M, N, K
// themselves are ints (each < 2^31).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 3 (shared memory cache-blocking).
// Next rung: sgemm_4_blocktile_1d.cu (several results per thread, kept in registers).

// row * ld + col as a 64-bit offset from a 32 x 32 -> 64-bit unsigned multiply (one
// IMAD.WIDE.U32): a signed long long product costs registers (rung 4: 39 -> 48, a block
// fewer per SM). Every argument is >= 0.
__device__ __forceinline__ unsigned long long at64(int row, int ld, int col) {
    return (unsigned long long)(unsigned)row * (unsigned)ld + (unsigned)col;
}

template <int TILE>
__device__ void sgemm_smem_tile(int M, int N, int K, float alpha, const float* A,
                                const float* B, float beta, float* C) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[at64(row, K, k0 + tx)] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[at64(k0 + ty, N, col)] : 0.0f;
        __syncthreads();  // the tiles are complete
        for (int k = 0; k < TILE; ++k) {
            acc += As[ty][k] * Bs[k][tx];
        }
        __syncthreads();  // everyone is done reading before the next step overwrites
    }
    if (row < M && col < N) {
        const unsigned long long at = at64(row, N, col);
        C[at] = alpha * acc + beta * C[at];
    }
}

extern "C" __global__ void sgemm_smem_8(int M, int N, int K, float alpha, const float* A,
                                        const float* B, float beta, float* C) {
    sgemm_smem_tile<8>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_smem_16(int M, int N, int K, float alpha, const float* A,
                                         const float* B, float beta, float* C) {
    sgemm_smem_tile<16>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_smem_32(int M, int N, int K, float alpha, const float* A,
                                         const float* B, float beta, float* C) {
    sgemm_smem_tile<32>(M, N, K, alpha, A, B, beta, C);
}
