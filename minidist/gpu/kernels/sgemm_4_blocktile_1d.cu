// sgemm_4_blocktile_1d: each thread computes TM results of a column of C, kept in registers.
//
// The idea: in sgemm_3 every FMA needs two shared-memory loads, so the loop runs at the
// speed of shared memory, not of the FMA units. Give each thread a column strip of TM
// results: for each k it loads B's value Bs[k][col] ONCE into a register and reuses it for
// TM FMAs against As[row .. row + TM - 1][k]. Shared loads per FMA fall from 2 to
// (1 + TM) / TM, and the block tile grows to BM x BN, so each global value is reused BN
// (for A) or BM (for B) times. Registers are the top of the hierarchy: the accumulators
// acc[TM] never leave them until the final store.
//
// A block of BM * BN / TM threads; thread t owns column tc = t % BN and rows
// tr * TM .. tr * TM + TM - 1 (tr = t / BN) of the block's tile. With BN >= 32 a warp
// shares tr, so its As reads are broadcasts and its Bs reads are 32 consecutive floats.
// Boehm measured 8475 GFLOP/s (36.5 % of cuBLAS) with BM = BN = 64, BK = 8, TM = 8.
//
// One thread's view (block (BM * BN / TM), grid (ceil(N/BN), ceil(M/BM))):
//     1. for k0 = 0, BK, ... < K:
//        a. the block copies A[bm.., k0..] (BM x BK) and B[k0.., bn..] (BK x BN) to shared
//           memory, each thread a strided share of the elements (0 outside A, B)
//        b. __syncthreads()
//        c. for k < BK: b = Bs[k][tc]; acc[i] += As[tr * TM + i][k] * b for i < TM
//        d. __syncthreads()
//     2. C[bm + tr * TM + i, bn + tc] = alpha * acc[i] + beta * C[...] (inside C)
//
// Shapes (row-major, float32): A (M, K), B (K, N), C (M, N); any M, N, K >= 1.
// Kernels (BM x BN x BK, TM): sgemm_1d_16x16x4_4 (64 threads), sgemm_1d_32x32x8_8 (128),
// sgemm_1d_64x64x8_8 (512, Boehm's). Shared memory: (BM + BN) * BK * 4 bytes.
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (MNK/BN + MNK/BM + 2MN).
// Bank conflicts: none, so no padding. With BN >= 32 a warp shares tr: its As reads are
// one address (a broadcast); with BN = 16 it spans tr and tr + 1, TM * BK = 16 words apart
// (different banks). Bs reads and both stores are consecutive words.
// 64-bit offsets: row * K, k * N and row * N are formed in 64 bits (at64, unsigned), so
// matrices with more than 2^31 elements (M K, K N or M N > 2^31) index correctly; M, N, K
// themselves are ints (each < 2^31).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 4 (1D blocktiling for calculating multiple results per thread).
// Next rung: sgemm_5_blocktile_2d.cu (a TM x TN square of results per thread).

// row * ld + col as a 64-bit offset from a 32 x 32 -> 64-bit unsigned multiply (one
// IMAD.WIDE.U32): a signed long long product costs registers (rung 4: 39 -> 48, a block
// fewer per SM). Every argument is >= 0.
__device__ __forceinline__ unsigned long long at64(int row, int ld, int col) {
    return (unsigned long long)(unsigned)row * (unsigned)ld + (unsigned)col;
}

template <int BM, int BN, int BK, int TM>
__device__ void sgemm_blocktile_1d(int M, int N, int K, float alpha, const float* A,
                                   const float* B, float beta, float* C) {
    constexpr int THREADS = BM * BN / TM;
    __shared__ float As[BM * BK];  // As[m * BK + k]
    __shared__ float Bs[BK * BN];  // Bs[k * BN + n]
    const int t = threadIdx.x, tc = t % BN, tr = t / BN;
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
    float acc[TM] = {0.0f};
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = t; i < BM * BK; i += THREADS) {
            const int m = bm + i / BK, k = k0 + i % BK;
            As[i] = (m < M && k < K) ? A[at64(m, K, k)] : 0.0f;
        }
        for (int i = t; i < BK * BN; i += THREADS) {
            const int k = k0 + i / BN, n = bn + i % BN;
            Bs[i] = (k < K && n < N) ? B[at64(k, N, n)] : 0.0f;
        }
        __syncthreads();  // both tiles are complete
        for (int k = 0; k < BK; ++k) {
            const float b = Bs[k * BN + tc];  // one shared load, reused TM times
            for (int i = 0; i < TM; ++i) {
                acc[i] += As[(tr * TM + i) * BK + k] * b;
            }
        }
        __syncthreads();  // reads done before the next tiles overwrite
    }
    const int n = bn + tc;
    for (int i = 0; i < TM; ++i) {
        const int m = bm + tr * TM + i;
        if (m < M && n < N) {
            const unsigned long long at = at64(m, N, n);
            C[at] = alpha * acc[i] + beta * C[at];
        }
    }
}

extern "C" __global__ void sgemm_1d_16x16x4_4(int M, int N, int K, float alpha, const float* A,
                                              const float* B, float beta, float* C) {
    sgemm_blocktile_1d<16, 16, 4, 4>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_1d_32x32x8_8(int M, int N, int K, float alpha, const float* A,
                                              const float* B, float beta, float* C) {
    sgemm_blocktile_1d<32, 32, 8, 8>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_1d_64x64x8_8(int M, int N, int K, float alpha, const float* A,
                                              const float* B, float beta, float* C) {
    sgemm_blocktile_1d<64, 64, 8, 8>(M, N, K, alpha, A, B, beta, C);
}
