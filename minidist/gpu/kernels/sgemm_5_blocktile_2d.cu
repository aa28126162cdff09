// sgemm_5_blocktile_2d: each thread computes a TM x TN square of C as an outer product.
//
// The idea: sgemm_4 reuses one value of B for TM FMAs; a square does better. For each k a
// thread loads TM values of A's column and TN values of B's row into registers (regM, regN)
// and does all TM * TN products between them: TM + TN shared loads feed TM * TN FMAs
// (8 + 8 loads for 64 FMAs at TM = TN = 8, 4x fewer per FMA than sgemm_4). Fewer threads
// each do more, with TM * TN accumulators held in registers. The block tile grows to
// 128 x 128, so every global value is reused 128 times: the kernel turns compute-bound.
// Boehm measured 15972 GFLOP/s (68.7 % of cuBLAS) with BM = BN = 128, BK = 8, TM = TN = 8.
//
// A block of (BM / TM) * (BN / TN) threads; thread t owns rows tr * TM .. + TM - 1 and
// columns tc * TN .. + TN - 1 of the block's tile (tr = t / (BN / TN), tc = t % (BN / TN)).
//
// One thread's view (block ((BM / TM) * (BN / TN)), grid (ceil(N/BN), ceil(M/BM))):
//     1. for k0 = 0, BK, ... < K:
//        a. the block copies A[bm.., k0..] (BM x BK) and B[k0.., bn..] (BK x BN) to shared
//           memory, each thread a strided share of the elements (0 outside A, B)
//        b. __syncthreads()
//        c. for k < BK: regM = As[tr * TM .. + TM][k]; regN = Bs[k][tc * TN .. + TN];
//           acc += outer(regM, regN)                                  (TM * TN FMAs)
//        d. __syncthreads()
//     2. C[the thread's TM x TN square] = alpha * acc + beta * C (inside C)
//
// Shapes (row-major, float32): A (M, K), B (K, N), C (M, N); any M, N, K >= 1.
// Kernels (BM x BN x BK, TM x TN): sgemm_2d_32x32x8_4x4 (64 threads), sgemm_2d_64x64x8_4x4
// (256), sgemm_2d_128x128x8_8x8 (256, Boehm's). Shared memory: (BM (BK + 1) + BK BN) * 4
// bytes (As padded, below).
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (MNK/BN + MNK/BM + 2MN).
// Bank conflicts (32 banks of 4-byte words; two lanes of a warp that read DIFFERENT words
// of one bank are served one after the other):
//   As reads: a warp spans 32 / (BN / TN) thread rows tr (2 at 128x128 8x8 and 64x64 4x4, 4
//     at 32x32 4x4), which read As[(tr TM + i) * BK + k]: TM BK = 64 or 32 words apart,
//     the SAME bank, a 2- or 4-way conflict on each of the TM loads per k. Fixed by padding
//     A's rows to BK + 1 words: the rows are TM (BK + 1) = 72 or 36 words apart, banks 8 or
//     4 apart. (The tile stores then meet a 2-way conflict on 3 banks, once per tile.)
//   Bs reads: lane tc reads Bs[k][tc TN + j], TN words apart: 16 lanes on 4 banks at TN = 8
//     (4-way), on 8 banks at 64x64 4x4 (2-way). Padding cannot help (the lanes read ONE row);
//     the fix is the lane layout of rung 7 (consecutive lanes on consecutive float4s).
// 64-bit offsets: row * K, k * N and row * N are formed in 64 bits (at64, unsigned), so
// matrices with more than 2^31 elements (M K, K N or M N > 2^31) index correctly; M, N, K
// themselves are ints (each < 2^31).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 5 (increasing arithmetic intensity via 2D blocktiling).
// Next rung: sgemm_6_vectorized.cu (128-bit loads, A transposed in shared memory).

// row * ld + col as a 64-bit offset from a 32 x 32 -> 64-bit unsigned multiply (one
// IMAD.WIDE.U32): a signed long long product costs registers (rung 4: 39 -> 48, a block
// fewer per SM). Every argument is >= 0.
__device__ __forceinline__ unsigned long long at64(int row, int ld, int col) {
    return (unsigned long long)(unsigned)row * (unsigned)ld + (unsigned)col;
}

template <int BM, int BN, int BK, int TM, int TN>
__device__ void sgemm_blocktile_2d(int M, int N, int K, float alpha, const float* A,
                                   const float* B, float beta, float* C) {
    constexpr int THREADS = (BM / TM) * (BN / TN);
    constexpr int LDA = BK + 1;     // As's padded row: thread rows land on different banks
    __shared__ float As[BM * LDA];  // As[m * LDA + k]
    __shared__ float Bs[BK * BN];  // Bs[k * BN + n]
    const int t = threadIdx.x, tc = t % (BN / TN), tr = t / (BN / TN);
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
    float acc[TM][TN] = {{0.0f}};
    float regM[TM], regN[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = t; i < BM * BK; i += THREADS) {
            const int m = bm + i / BK, k = k0 + i % BK;
            As[(i / BK) * LDA + i % BK] = (m < M && k < K) ? A[at64(m, K, k)] : 0.0f;
        }
        for (int i = t; i < BK * BN; i += THREADS) {
            const int k = k0 + i / BN, n = bn + i % BN;
            Bs[i] = (k < K && n < N) ? B[at64(k, N, n)] : 0.0f;
        }
        __syncthreads();  // both tiles are complete
        for (int k = 0; k < BK; ++k) {
            for (int i = 0; i < TM; ++i) regM[i] = As[(tr * TM + i) * LDA + k];
            for (int j = 0; j < TN; ++j) regN[j] = Bs[k * BN + tc * TN + j];
            for (int i = 0; i < TM; ++i) {
                for (int j = 0; j < TN; ++j) acc[i][j] += regM[i] * regN[j];
            }
        }
        __syncthreads();  // reads done before the next tiles overwrite
    }
    for (int i = 0; i < TM; ++i) {
        const int m = bm + tr * TM + i;
        for (int j = 0; j < TN; ++j) {
            const int n = bn + tc * TN + j;
            if (m < M && n < N) {
                const unsigned long long at = at64(m, N, n);
                C[at] = alpha * acc[i][j] + beta * C[at];
            }
        }
    }
}

extern "C" __global__ void sgemm_2d_32x32x8_4x4(int M, int N, int K, float alpha,
                                                const float* A, const float* B, float beta,
                                                float* C) {
    sgemm_blocktile_2d<32, 32, 8, 4, 4>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_2d_64x64x8_4x4(int M, int N, int K, float alpha,
                                                const float* A, const float* B, float beta,
                                                float* C) {
    sgemm_blocktile_2d<64, 64, 8, 4, 4>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_2d_128x128x8_8x8(int M, int N, int K, float alpha,
                                                  const float* A, const float* B, float beta,
                                                  float* C) {
    sgemm_blocktile_2d<128, 128, 8, 8, 8>(M, N, K, alpha, A, B, beta, C);
}
