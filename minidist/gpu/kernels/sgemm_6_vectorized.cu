// sgemm_6_vectorized: sgemm_5 with 128-bit (float4) loads and A transposed in shared memory.
//
// The idea: the loop of sgemm_5 is now limited by how many load INSTRUCTIONS it issues, not
// by bytes. A float4 load moves 16 bytes in one instruction (LDG.128 / LDS.128) where four
// scalar loads need four. Two changes make every hot load a float4:
//   - global -> shared: A and B are read four consecutive floats at a time;
//   - A is stored TRANSPOSED in shared memory, As[k][m], so the TM values a thread needs
//     for one k (a column of A's tile) are contiguous and come in TM / 4 LDS.128; B's row
//     Bs[k][n..n+TN) already is. The final read-modify-write of C is float4 too.
// Same tiles, same FLOPs, same bytes as sgemm_5; fewer load instructions per byte.
// Boehm measured 18237 GFLOP/s (78.4 % of cuBLAS) with BM = BN = 128, BK = 8, TM = TN = 8.
//
// One thread's view (block ((BM / TM) * (BN / TN)), grid (ceil(N/BN), ceil(M/BM))):
//     1. for k0 = 0, BK, ... < K:
//        a. float4 chunks: A[m, k0+4c .. +4] -> As[k0+4c+q][m] for q < 4 (transposed),
//           B[k0+r, n .. n+4] -> Bs[r][n .. n+4]; chunks outside A, B are zeros
//        b. __syncthreads()
//        c. for k < BK: regM = As[k][tr*TM .. +TM], regN = Bs[k][tc*TN .. +TN] (float4 reads);
//           acc += outer(regM, regN)
//        d. __syncthreads()
//     2. C[the thread's TM x TN square] = alpha * acc + beta * C, in float4 pieces (inside C)
//
// Shapes (row-major, float32): A (M, K), B (K, N), C (M, N); any M; K and N MULTIPLES OF 4
// (a float4 must be 16-byte aligned and lie wholly inside or outside a row), base pointers
// 16-byte aligned; TM, TN, BK multiples of 4. The launcher refuses other shapes.
// Kernels (BM x BN x BK, TM x TN): sgemm_vec_32x32x8_4x4 (64 threads), sgemm_vec_64x64x8_4x4
// (256), sgemm_vec_128x128x8_8x8 (256, Boehm's). Shared memory: ((BM + 4) + BN) * BK * 4
// bytes (As padded, below).
// Memory traffic: compulsory 4 (MK + KN + 2MN) bytes; issued 4 (MNK/BN + MNK/BM + 2MN).
// Bank conflicts (an LDS.128 is served a quarter warp, 8 lanes, at a time; 4-byte STS a
// warp at a time):
//   As stores: a warp's 32 threads store float4s of rows m = 0..15 at k offsets kq = 0, 4;
//     with rows BM words long, As[(kq + q) BM + m] puts kq = 0 and kq = 4 on the same bank
//     (4 BM is a multiple of 32): a 2-way conflict on all 4 stores per float4. Fixed by
//     padding As's rows to BM + 4 words: kq = 4 moves 16 banks over. (+4, not +1: a row
//     must start on a 16-byte boundary for the LDS.128 reads.)
//   As reads: the 8 lanes of a quarter warp share tr: one address, a broadcast.
//   Bs reads at 128x128 8x8: lanes tc = 0..7 read float4s 8 words apart, on banks 0-3,
//     8-11, 16-19, 24-27, then again 0-3, ...: 2-way. Not a padding problem (one row);
//     rung 7's lane layout reads consecutive float4s. At 4x4 they are 4 words apart: none.
// 64-bit offsets: row * K, k * N and row * N are formed in 64 bits (at64, unsigned), so
// matrices with more than 2^31 elements (M K, K N or M N > 2^31) index correctly; M, N, K
// themselves are ints (each < 2^31).
// Reference: S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like
//     Performance", kernel 6 (vectorize SMEM and GMEM accesses).
// Next rung: sgemm_7_warptile.cu (a warp's tile between the block's and the thread's).

// row * ld + col as a 64-bit offset from a 32 x 32 -> 64-bit unsigned multiply (one
// IMAD.WIDE.U32): a signed long long product costs registers (rung 4: 39 -> 48, a block
// fewer per SM). Every argument is >= 0.
__device__ __forceinline__ unsigned long long at64(int row, int ld, int col) {
    return (unsigned long long)(unsigned)row * (unsigned)ld + (unsigned)col;
}

template <int BM, int BN, int BK, int TM, int TN>
__device__ void sgemm_vectorized(int M, int N, int K, float alpha, const float* A,
                                 const float* B, float beta, float* C) {
    constexpr int THREADS = (BM / TM) * (BN / TN);
    constexpr int LDA = BM + 4;         // As's padded row (a multiple of 4: float4-aligned)
    __shared__ float4 As4[BK * LDA / 4];  // float4 storage keeps the LDS.128 reads aligned
    __shared__ float4 Bs4[BK * BN / 4];
    float* As = reinterpret_cast<float*>(As4);  // As[k * LDA + m]: A's tile transposed
    const int t = threadIdx.x, tc = t % (BN / TN), tr = t / (BN / TN);
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
    float acc[TM][TN] = {{0.0f}};
    float regM[TM], regN[TN];
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
            Bs4[i] = b;  // i = k * BN / 4 + nq / 4
        }
        __syncthreads();  // both tiles are complete
        for (int k = 0; k < BK; ++k) {
            for (int i = 0; i < TM / 4; ++i) {
                const float4 a = As4[(k * LDA + tr * TM) / 4 + i];
                regM[4 * i] = a.x, regM[4 * i + 1] = a.y, regM[4 * i + 2] = a.z;
                regM[4 * i + 3] = a.w;
            }
            for (int j = 0; j < TN / 4; ++j) {
                const float4 b = Bs4[(k * BN + tc * TN) / 4 + j];
                regN[4 * j] = b.x, regN[4 * j + 1] = b.y, regN[4 * j + 2] = b.z;
                regN[4 * j + 3] = b.w;
            }
            for (int i = 0; i < TM; ++i) {
                for (int j = 0; j < TN; ++j) acc[i][j] += regM[i] * regN[j];
            }
        }
        __syncthreads();  // reads done before the next tiles overwrite
    }
    for (int i = 0; i < TM; ++i) {
        const int m = bm + tr * TM + i;
        for (int j = 0; j < TN; j += 4) {
            const int n = bn + tc * TN + j;
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

extern "C" __global__ void sgemm_vec_32x32x8_4x4(int M, int N, int K, float alpha,
                                                 const float* A, const float* B, float beta,
                                                 float* C) {
    sgemm_vectorized<32, 32, 8, 4, 4>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_vec_64x64x8_4x4(int M, int N, int K, float alpha,
                                                 const float* A, const float* B, float beta,
                                                 float* C) {
    sgemm_vectorized<64, 64, 8, 4, 4>(M, N, K, alpha, A, B, beta, C);
}

extern "C" __global__ void sgemm_vec_128x128x8_8x8(int M, int N, int K, float alpha,
                                                   const float* A, const float* B, float beta,
                                                   float* C) {
    sgemm_vectorized<128, 128, 8, 8, 8>(M, N, K, alpha, A, B, beta, C);
}
