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
// (256), sgemm_2d_128x128x8_8x8 (256, Boehm's). Shared memory: (BM + BN) * BK * 4 bytes.
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (MNK/BN + MNK/BM + 2MN).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 5 (increasing arithmetic intensity via 2D blocktiling).
// Next rung: sgemm_6_vectorized.cu (128-bit loads, A transposed in shared memory).

template <int BM, int BN, int BK, int TM, int TN>
__device__ void sgemm_blocktile_2d(int M, int N, int K, float alpha, const float* A,
                                   const float* B, float beta, float* C) {
    constexpr int THREADS = (BM / TM) * (BN / TN);
    __shared__ float As[BM * BK];  // As[m * BK + k]
    __shared__ float Bs[BK * BN];  // Bs[k * BN + n]
    const int t = threadIdx.x, tc = t % (BN / TN), tr = t / (BN / TN);
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
    float acc[TM][TN] = {{0.0f}};
    float regM[TM], regN[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = t; i < BM * BK; i += THREADS) {
            const int m = bm + i / BK, k = k0 + i % BK;
            As[i] = (m < M && k < K) ? A[m * K + k] : 0.0f;
        }
        for (int i = t; i < BK * BN; i += THREADS) {
            const int k = k0 + i / BN, n = bn + i % BN;
            Bs[i] = (k < K && n < N) ? B[k * N + n] : 0.0f;
        }
        __syncthreads();  // both tiles are complete
        for (int k = 0; k < BK; ++k) {
            for (int i = 0; i < TM; ++i) regM[i] = As[(tr * TM + i) * BK + k];
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
            if (m < M && n < N) C[m * N + n] = alpha * acc[i][j] + beta * C[m * N + n];
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
