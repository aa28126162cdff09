// sgemm_7_warptile: a tile level for the warp, between the block's tile and the thread's.
//
// The idea: the hardware schedules warps, not threads. sgemm_6 lays its threads over the
// block tile row by row, so a warp's 32 threads cover a long thin strip of C and together
// read many scattered words of As and Bs. Here each warp owns a compact WM x WN warp tile,
// computed in WMITER x WNITER sub-tiles of WSUBM x WSUBN; inside a sub-tile the 32 lanes form
// a (WSUBM / TM) x (WSUBN / TN) grid and each lane computes TM x TN results. For one k a warp
// reads only WM values of As and WN of Bs (broadcast to the lanes that share them), each
// thread keeps WMITER * TM + WNITER * TN operands and WMITER * WNITER * TM * TN
// accumulators in registers, and consecutive lanes read consecutive shared words. The
// warp tile is also the unit a tensor-core MMA works on (the next step beyond FP32 SIMT).
// Boehm measured 21779 GFLOP/s (93.7 % of cuBLAS) for his warptiling kernel 10.
//
// One thread's view (block 32 * (BM / WM) * (BN / WN), grid (ceil(N/BN), ceil(M/BM))):
//     warp w = t / 32 at warp-tile (w / (BN / WN), w % (BN / WN)); lane l = t % 32 at
//     (l / (WSUBN / TN), l % (WSUBN / TN)) inside each sub-tile.
//     1. for k0 = 0, BK, ... < K:
//        a. float4 chunks of A (transposed into As[k][m]) and B (Bs[k][n]), as sgemm_6
//        b. __syncthreads()
//        c. for k < BK: regM = the lane's TM values of As[k] in each of the WMITER sub-tiles,
//           regN = its TN values of Bs[k] in each of the WNITER sub-tiles;
//           acc += outer(regM, regN)                      (WMITER WNITER TM TN FMAs)
//        d. __syncthreads()
//     2. C[the thread's WMITER x WNITER squares of TM x TN] = alpha * acc + beta * C
//
// Shapes (row-major, float32): A (M, K), B (K, N), C (M, N); any M; K and N MULTIPLES OF 4
// (float4 loads, as sgemm_6), base pointers 16-byte aligned; TM, TN multiples of 4.
// Kernels (BM x BN x BK, WM x WN, WNITER, TM x TN): sgemm_warp_32x64x8_32x32_2_4x4 (64
// threads), sgemm_warp_64x64x8_32x32_2_4x4 (128), sgemm_warp_128x128x16_64x64_4_8x4 (128,
// Boehm's configuration for kernel 10). Shared memory: (BM + BN) * BK * 4 bytes.
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (MNK/BN + MNK/BM + 2MN).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 10 (warptiling).
// Top of the ladder: cuBLAS (cupy.matmul) is the yardstick; see minidist/gpu/hierarchy.py.

template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN>
__device__ void sgemm_warptile(int M, int N, int K, float alpha, const float* A,
                               const float* B, float beta, float* C) {
    constexpr int THREADS = 32 * (BM / WM) * (BN / WN);
    constexpr int WMITER = (WM * WN) / (32 * TM * TN * WNITER);
    constexpr int WSUBM = WM / WMITER, WSUBN = WN / WNITER;
    static_assert((WSUBM / TM) * (WSUBN / TN) == 32, "a sub-tile must hold one warp");
    __shared__ float4 As4[BK * BM / 4];  // As[k * BM + m]: A's tile transposed
    __shared__ float4 Bs4[BK * BN / 4];  // Bs[k * BN + n]
    float* As = reinterpret_cast<float*>(As4);
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int wr = (warp / (BN / WN)) * WM, wc = (warp % (BN / WN)) * WN;  // warp tile origin
    const int lr = (lane / (WSUBN / TN)) * TM, lc = (lane % (WSUBN / TN)) * TN;
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
    float acc[WMITER * TM][WNITER * TN] = {{0.0f}};
    float regM[WMITER * TM], regN[WNITER * TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = t; i < BM * BK / 4; i += THREADS) {
            const int m = i / (BK / 4), kq = (i % (BK / 4)) * 4;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (bm + m < M && k0 + kq < K) {
                a = reinterpret_cast<const float4*>(&A[(bm + m) * K + k0 + kq])[0];
            }
            As[(kq + 0) * BM + m] = a.x;
            As[(kq + 1) * BM + m] = a.y;
            As[(kq + 2) * BM + m] = a.z;
            As[(kq + 3) * BM + m] = a.w;
        }
        for (int i = t; i < BK * BN / 4; i += THREADS) {
            const int k = i / (BN / 4), nq = (i % (BN / 4)) * 4;
            float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (k0 + k < K && bn + nq < N) {
                b = reinterpret_cast<const float4*>(&B[(k0 + k) * N + bn + nq])[0];
            }
            Bs4[i] = b;
        }
        __syncthreads();  // both tiles are complete
        for (int k = 0; k < BK; ++k) {
            for (int s = 0; s < WMITER; ++s) {
                for (int i = 0; i < TM; i += 4) {
                    const float4 a = As4[(k * BM + wr + s * WSUBM + lr + i) / 4];
                    regM[s * TM + i] = a.x, regM[s * TM + i + 1] = a.y;
                    regM[s * TM + i + 2] = a.z, regM[s * TM + i + 3] = a.w;
                }
            }
            for (int s = 0; s < WNITER; ++s) {
                for (int j = 0; j < TN; j += 4) {
                    const float4 b = Bs4[(k * BN + wc + s * WSUBN + lc + j) / 4];
                    regN[s * TN + j] = b.x, regN[s * TN + j + 1] = b.y;
                    regN[s * TN + j + 2] = b.z, regN[s * TN + j + 3] = b.w;
                }
            }
            for (int i = 0; i < WMITER * TM; ++i) {
                for (int j = 0; j < WNITER * TN; ++j) acc[i][j] += regM[i] * regN[j];
            }
        }
        __syncthreads();  // reads done before the next tiles overwrite
    }
    for (int i = 0; i < WMITER * TM; ++i) {
        const int m = bm + wr + (i / TM) * WSUBM + lr + i % TM;
        for (int j = 0; j < WNITER * TN; j += 4) {
            const int n = bn + wc + (j / TN) * WSUBN + lc + j % TN;
            if (m < M && n < N) {
                float4* c = reinterpret_cast<float4*>(&C[m * N + n]);
                float4 v = c[0];
                v.x = alpha * acc[i][j] + beta * v.x;
                v.y = alpha * acc[i][j + 1] + beta * v.y;
                v.z = alpha * acc[i][j + 2] + beta * v.z;
                v.w = alpha * acc[i][j + 3] + beta * v.w;
                c[0] = v;
            }
        }
    }
}

extern "C" __global__ void sgemm_warp_32x64x8_32x32_2_4x4(int M, int N, int K, float alpha,
                                                          const float* A, const float* B,
                                                          float beta, float* C) {
    sgemm_warptile<32, 64, 8, 32, 32, 2, 4, 4>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_warp_64x64x8_32x32_2_4x4(int M, int N, int K, float alpha,
                                                          const float* A, const float* B,
                                                          float beta, float* C) {
    sgemm_warptile<64, 64, 8, 32, 32, 2, 4, 4>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_warp_128x128x16_64x64_4_8x4(int M, int N, int K, float alpha,
                                                             const float* A, const float* B,
                                                             float beta, float* C) {
    sgemm_warptile<128, 128, 16, 64, 64, 4, 8, 4>(M, N, K, alpha, A, B, beta, C);
}
