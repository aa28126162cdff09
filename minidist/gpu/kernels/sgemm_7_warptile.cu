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
// threads), sgemm_warp_64x64x8_32x32_2_4x4 (128), sgemm_warp_128x128x8_64x32_2_8x4 (256,
// the ladder's). Shared memory: ((BM + 4) + BN) * BK * 4 bytes (As padded, below).
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (MNK/BN + MNK/BM + 2MN).
// Bank conflicts (an LDS.128 is served 8 lanes at a time):
//   As, Bs reads: a quarter warp is lanes 0-7, two lane rows of a sub-tile: its As reads
//     are 2 float4s TM words apart (lr = 0, TM: banks 0-3 and TM..TM+3), its Bs reads 4
//     consecutive float4s (lc = 0, 4, 8, 12: banks 0-15). No conflict, where sgemm_6's Bs
//     reads at 128x128 8x8 were 2-way.
//   As stores: as sgemm_6, 2-way with rows of BM words when BK = 8, so As's rows are padded
//     to BM + 4 words (16 banks over for kq = 4; 16-byte aligned for LDS.128). With BK = 16
//     (Boehm's) a warp stores 4 k offsets per row: 4-way unpadded, still 2-way padded.
// Why not Boehm's kernel-10 configuration (128x128x16, 64x64 warp tiles, 4 x 1 sub-tiles
// of 8 x 4, 128 threads)? On the H200 it ran at 25.7 TFLOP/s, below rung 6's 26.8 at 4096^3.
// ptxas gives it 168 registers (128 accumulators + 24 operands), so 168 * 128 = 21504 of an
// SM's 65536 registers a block: 3 blocks (12 warps) an SM, 396 blocks a wave on 132 SMs.
// 4096^3 is 32 x 32 = 1024 blocks: waves of 396, 396 and 232, the last 59 % full, so 14 %
// of the time the SMs idle (1024 / (3 * 396) = 86 %); rung 6 (123 registers, 256 threads: 2
// blocks, 264 a wave) runs 4 waves with 3 % idle. The ladder's configuration here keeps
// rung 6's occupancy (64 accumulators, at most 128 registers by __launch_bounds__(256, 2):
// 2 blocks of 8 warps an SM, 97 % of the 4 waves busy at 4096^3) and its loads per FMA (2
// LDS.128 of As and 2 of Bs per k for 64 FMAs), with the warp tile's conflict-free reads.
// 64-bit offsets: row * K, k * N and row * N are formed in 64 bits (at64, unsigned), so
// matrices with more than 2^31 elements (M K, K N or M N > 2^31) index correctly; M, N, K
// themselves are ints (each < 2^31).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 10 (warptiling).
// Top of the ladder: cuBLAS (cupy.matmul) is the yardstick; see minidist/gpu/hierarchy.py.

// row * ld + col as a 64-bit offset from a 32 x 32 -> 64-bit unsigned multiply (one
// IMAD.WIDE.U32): a signed long long product costs registers (rung 4: 39 -> 48, a block
// fewer per SM). Every argument is >= 0.
__device__ __forceinline__ unsigned long long at64(int row, int ld, int col) {
    return (unsigned long long)(unsigned)row * (unsigned)ld + (unsigned)col;
}

template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN>
__device__ void sgemm_warptile(int M, int N, int K, float alpha, const float* A,
                               const float* B, float beta, float* C) {
    constexpr int THREADS = 32 * (BM / WM) * (BN / WN);
    constexpr int WMITER = (WM * WN) / (32 * TM * TN * WNITER);
    constexpr int WSUBM = WM / WMITER, WSUBN = WN / WNITER;
    static_assert((WSUBM / TM) * (WSUBN / TN) == 32, "a sub-tile must hold one warp");
    constexpr int LDA = BM + 4;           // As's padded row (a multiple of 4: float4-aligned)
    __shared__ float4 As4[BK * LDA / 4];  // As[k * LDA + m]: A's tile transposed
    __shared__ float4 Bs4[BK * BN / 4];   // Bs[k * BN + n]
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
                a = reinterpret_cast<const float4*>(&A[at64(bm + m, K, k0 + kq)])[0];
            }
            As[(kq + 0) * LDA + m] = a.x;
            As[(kq + 1) * LDA + m] = a.y;
            As[(kq + 2) * LDA + m] = a.z;
            As[(kq + 3) * LDA + m] = a.w;
        }
        for (int i = t; i < BK * BN / 4; i += THREADS) {
            const int k = i / (BN / 4), nq = (i % (BN / 4)) * 4;
            float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (k0 + k < K && bn + nq < N) {
                b = reinterpret_cast<const float4*>(&B[at64(k0 + k, N, bn + nq)])[0];
            }
            Bs4[i] = b;
        }
        __syncthreads();  // both tiles are complete
        for (int k = 0; k < BK; ++k) {
            for (int s = 0; s < WMITER; ++s) {
                for (int i = 0; i < TM; i += 4) {
                    const float4 a = As4[(k * LDA + wr + s * WSUBM + lr + i) / 4];
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
                float4* c = reinterpret_cast<float4*>(&C[at64(m, N, n)]);
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

// 2 blocks of 256 threads an SM: at most 65536 / 512 = 128 registers a thread.
extern "C" __global__ void __launch_bounds__(256, 2)
sgemm_warp_128x128x8_64x32_2_8x4(int M, int N, int K, float alpha, const float* A,
                                 const float* B, float beta, float* C) {
    sgemm_warptile<128, 128, 8, 64, 32, 2, 8, 4>(M, N, K, alpha, A, B, beta, C);
}
