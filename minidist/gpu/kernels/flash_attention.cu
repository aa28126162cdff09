// flash_attention: attention forward with an online softmax over tiles of keys in shared
// memory, so the (T, T) score matrix never exists in global memory.
//
// Math, per head and query row i (Dao et al. 2022, "FlashAttention", arXiv:2205.14135,
// Algorithm 1; the online softmax of Milakov & Gimelshein 2018, arXiv:1805.02867):
//   s_j = scale q_i . k_j for the keys j this row may see (j <= i when causal)
//   o_i = sum_j softmax(s)_j v_j,    lse_i = log sum_j exp(s_j)
// The online softmax keeps a running max m, running sum l and unnormalised output acc,
// and takes the keys one at a time, each with its score s_j:
//   if s_j > m:  c = exp(m - s_j),  l = c l,  acc = c acc,  m = s_j   (rescale the past)
//   p = exp(s_j - m),   l = l + p,   acc = acc + p v_j
// and at the end o_i = acc / l, lse_i = m + log l: the same numbers as the full softmax.
// (FlashAttention rescales once per tile instead; per key needs no array of scores, which
// on sm_90 spilled registers: 160 live floats per thread with q, acc and 32 scores.)
//
// One block's view: block (x, y) takes query rows q0 = x * blockDim.x, ... q0+blockDim.x-1
// of head y, one thread per row; the thread keeps its q row (pre-scaled) and acc in
// registers (FA_MAX_D floats each). Then for each tile of FA_BC keys:
//   1. barrier; the threads copy the tile's K and V rows to shared memory, row jj of the
//      tile at jj * FA_MAX_D floats (a 16-byte boundary for any D), columns D..D4-1 zeros
//      (D4 = D rounded up to 4), zeros past the last key; barrier
//   2. each thread scores its row against the tile's keys it may see and applies the
//      online-softmax update above to each
// With causal masking the block stops after the tile that holds its last query row: the
// keys after it are in every row's future.
// Shared-memory loads: every thread of a warp reads the same key row at the same time (a
// broadcast: no bank conflicts), so the inner loops were bound by the NUMBER of loads, one
// LDS.32 per FMA in both the score and the acc update. They read float4s (LDS.128) instead:
// 4 floats per load instruction, D4 / 4 loads per key per loop instead of D. The score
// adds its four float4 lanes in four separate sums (s = (s0 + s1) + (s2 + s3)): four
// independent FMA chains of D4 / 4 instead of one chain of D dependent FMAs (a different
// order of additions than the twin's; within TOL_ATTENTION).
//
// Shapes: q, k, v, o (BH, T, D) row-major, D <= FA_MAX_D; lse (BH, T). Grid
//   (ceil(T / blockDim.x), BH). Shared memory: 2 * FA_BC * FA_MAX_D * 4 B = 16 KiB, as
//   float4s (16-byte aligned for LDS.128).
// Memory traffic: compulsory 4 (4 BH T D + BH T) B (read Q, K, V once, write O and lse).
//   Actual: K and V are read once per query block, ceil(T / blockDim.x) times (half that
//   with causal masking), from L2 after the first. The unfused version (unfused.cu) writes
//   the (BH, T, T) scores and re-reads them at every step: 10 BH T^2 numbers more.
// Twin: minidist/gpu/twins.py::flash_attention (the same tiles in NumPy) and ::attention
//   (the plain softmax(q k^T) v, float64).

#define FA_BC 32     // keys per tile
#define FA_MAX_D 64  // the largest head dimension: q and acc live in registers

extern "C" __global__ void flash_attention_forward(const float* __restrict__ q,
                                                   const float* __restrict__ k,
                                                   const float* __restrict__ v,
                                                   float* __restrict__ o,
                                                   float* __restrict__ lse, int T, int D,
                                                   float scale, int causal) {
  __shared__ float4 k_tile4[FA_BC * FA_MAX_D / 4];  // key jj's d4-th float4: [jj * 16 + d4]
  __shared__ float4 v_tile4[FA_BC * FA_MAX_D / 4];
  float* k_tile = reinterpret_cast<float*>(k_tile4);  // the same tiles, one float at a time
  float* v_tile = reinterpret_cast<float*>(v_tile4);
  const float neg_inf = __uint_as_float(0xff800000u);
  const long long head = (long long)blockIdx.y * T * D;
  const int q0 = blockIdx.x * blockDim.x, i = q0 + threadIdx.x;  // this thread's query row
  const bool row_ok = i < T;
  const int D4 = (D + 3) / 4 * 4;  // columns stored per key row; D..D4-1 are zeros
  float q_row[FA_MAX_D], acc[FA_MAX_D];
#pragma unroll
  for (int d = 0; d < FA_MAX_D; ++d) {
    q_row[d] = (row_ok && d < D) ? scale * q[head + (long long)i * D + d] : 0.0f;
    acc[d] = 0.0f;
  }
  float m = neg_inf, l = 0.0f;
  const int kv_end = causal ? min(T, q0 + (int)blockDim.x) : T;  // keys this block can see
  for (int k0 = 0; k0 < kv_end; k0 += FA_BC) {
    __syncthreads();  // every thread is done with the previous tile
    for (int e = threadIdx.x; e < FA_BC * D4; e += blockDim.x) {
      const int jj = e / D4, d = e % D4;  // key k0 + jj, column d
      const bool inside = k0 + jj < T && d < D;  // the last tile may run past the last key
      const long long at = head + (long long)(k0 + jj) * D + d;
      k_tile[jj * FA_MAX_D + d] = inside ? k[at] : 0.0f;
      v_tile[jj * FA_MAX_D + d] = inside ? v[at] : 0.0f;
    }
    __syncthreads();  // the tile is in shared memory
    const int tile_end = min(FA_BC, T - k0);  // the keys of this tile that exist
    for (int jj = 0; jj < tile_end; ++jj) {
      if (!row_ok || (causal && k0 + jj > i)) break;  // this key and the rest are masked
      const float4* kj = &k_tile4[jj * (FA_MAX_D / 4)];
      const float4* vj = &v_tile4[jj * (FA_MAX_D / 4)];
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll
      for (int d4 = 0; d4 < FA_MAX_D / 4; ++d4) {
        if (4 * d4 < D) {  // one LDS.128, broadcast to the warp
          const float4 kk = kj[d4];
          s0 += q_row[4 * d4] * kk.x;
          s1 += q_row[4 * d4 + 1] * kk.y;
          s2 += q_row[4 * d4 + 2] * kk.z;
          s3 += q_row[4 * d4 + 3] * kk.w;
        }
      }
      const float s = (s0 + s1) + (s2 + s3);
      if (s > m) {  // a new running max: rescale what was summed so far
        const float c = expf(m - s);
        l *= c;
#pragma unroll
        for (int d = 0; d < FA_MAX_D; ++d) acc[d] *= c;
        m = s;
      }
      const float p = expf(s - m);
      l += p;
#pragma unroll
      for (int d4 = 0; d4 < FA_MAX_D / 4; ++d4) {
        if (4 * d4 < D) {
          const float4 vv = vj[d4];
          acc[4 * d4] += p * vv.x;
          acc[4 * d4 + 1] += p * vv.y;
          acc[4 * d4 + 2] += p * vv.z;
          acc[4 * d4 + 3] += p * vv.w;
        }
      }
    }
  }
  if (row_ok) {
#pragma unroll
    for (int d = 0; d < FA_MAX_D; ++d)  // unrolled, so acc stays in registers
      if (d < D) o[head + (long long)i * D + d] = acc[d] / l;
    lse[(long long)blockIdx.y * T + i] = m + logf(l);
  }
}
