// layernorm: fused LayerNorm forward, and its backward with dw, db by a two-stage reduction.
//
// Math, per row x of length C (Ba, Kiros & Hinton 2016, arXiv:1607.06450, Sec. 3):
//   mu = mean_c x_c,   r = 1 / sqrt(mean_c (x_c - mu)^2 + eps),   xhat = (x - mu) r
//   y = xhat * w + b
// Backward, with dxhat = dy * w:
//   dx = r (dxhat - mean_c dxhat_c - xhat * mean_c (dxhat_c xhat_c))
//   dw = sum over rows of dy * xhat,   db = sum over rows of dy
// Why fused: the unfused sequence (unfused.cu: mean, var, normalize, scale+shift) makes four
// launches and writes and re-reads the (N, C) xhat; this kernel reads x and writes y once.
//
// One block's view (forward): the block owns rows blockIdx.x, blockIdx.x + gridDim.x, ...
//   1. each thread adds up its columns c = threadIdx.x, + blockDim.x, ...; block_sum -> mu
//   2. the same for (x - mu)^2 -> r (two passes: one-pass E[x^2] - mu^2 cancels badly)
//   3. each thread writes y for its columns; thread 0 keeps mean and rstd for the backward
// Backward, stage 1 (layernorm_backward): block g of G owns rows g, g + G, g + 2G, ...
//   (G = gridDim.x, a few blocks per SM: LN_BWD_BLOCKS in gpu/fused.py). Per row, two block
//   sums give the two means, then each thread writes dx for its columns c = threadIdx.x,
//   + blockDim.x, ... and adds dy*xhat and dy into ITS columns of the block's partial row,
//   which lives in shared memory (part_w, part_b: 2C floats of dynamic shared memory, a
//   column is only ever touched by the one thread that owns it: no atomics, no barrier,
//   consecutive threads on consecutive banks). After its last row the block writes its
//   partial row to dw_part[g, :], db_part[g, :] once: 2C stores per block, not a global
//   read-modify-write of 2C numbers per row.
// Stage 2 (layernorm_param_grads): block (32, R) owns 32 columns; thread (x, y) adds the
//   partial rows y, y + R, y + 2R, ... of column 32 blockIdx.x + x (a warp reads 32
//   consecutive floats of a row: one 128-byte line), then thread (x, 0) adds the R sums in
//   order y = 0..R-1. R = min(G, 32): at G = 1024 a block is 32 x 32 threads and a thread
//   adds 32 rows, where a thread per column would add G = 1024 in a latency-bound chain
//   (1024 threads with a few loads in flight each: ~100 us for the 8 MiB of partials).
//   Deterministic: the same additions in the same order on every run.
// block_sum: each warp adds its 32 values with 5 xor-shuffles, lane 0 stores the warp's sum
//   in shared memory, and after a barrier every thread adds the warp sums in the same
//   order, so all threads hold the same bits.
//
// Shapes: x, y, dy, dx (N, C) row-major; w, b, dw, db (C,); mean, rstd (N,); dw_part,
//   db_part (G, C), G = gridDim.x of the backward. blockDim.x a multiple of 32, <= 1024;
//   stage 2: blockDim (32, R), R = min(G, 32). Shared memory of stage 1: 8 C bytes (dynamic), so
//   C <= 29040 at sm_90's 227 KiB (gpu/fused.py refuses more).
// Occupancy (H200, 132 SMs, C = 1024, 128 threads, 32 registers): G = 1024 blocks is ~8 a
//   SM, 1024 threads (half of the SM's 2048) with 8 KiB of shared memory each: enough
//   loads in flight to run at HBM bandwidth. The old grid (G <= 256) held ~250 threads a SM.
// Memory traffic (compulsory, float32, 4 bytes a number): forward reads x, w, b and writes
//   y, mean, rstd: 4 (2NC + 2C + 2N) B. Backward reads dy, x, w, mean, rstd and writes dx:
//   4 (3NC + C + 2N) B; the partials add 4 * 4GC B (written once, read once by stage 2:
//   16 MiB at G = C = 1024, 4 % of the 384 MiB of dy, x, dx at N = 32768), and dw, db 4 * 2C.
// Twin: minidist/autograd/fused.py::LayerNorm (float64); launches: minidist/gpu/fused.py.

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the block, returned to every thread; scratch: 32 floats of shared memory.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();  // every warp's sum is in scratch
  float total = 0.0f;
  for (int i = 0; i < n_warps; ++i) total += scratch[i];
  return total;
}

extern "C" __global__ void layernorm_forward(const float* __restrict__ x,
                                             const float* __restrict__ w,
                                             const float* __restrict__ b,
                                             float* __restrict__ y, float* __restrict__ mean,
                                             float* __restrict__ rstd, int N, int C, float eps) {
  __shared__ float scratch[32];
  for (int row = blockIdx.x; row < N; row += gridDim.x) {  // the same rows for all threads
    const float* xr = x + (long long)row * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += xr[c];
    const float mu = block_sum(s, scratch) / C;
    float q = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = xr[c] - mu;
      q += d * d;
    }
    const float r = rsqrtf(block_sum(q, scratch) / C + eps);
    float* yr = y + (long long)row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) yr[c] = (xr[c] - mu) * r * w[c] + b[c];
    if (threadIdx.x == 0) {
      mean[row] = mu;
      rstd[row] = r;
    }
  }
}

extern "C" __global__ void layernorm_backward(const float* __restrict__ dy,
                                              const float* __restrict__ x,
                                              const float* __restrict__ w,
                                              const float* __restrict__ mean,
                                              const float* __restrict__ rstd,
                                              float* __restrict__ dx,
                                              float* __restrict__ dw_part,
                                              float* __restrict__ db_part, int N, int C) {
  __shared__ float scratch[32];
  extern __shared__ float part[];  // 2C floats: this block's partial dw, then db
  float* part_w = part;
  float* part_b = part + C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) part_w[c] = part_b[c] = 0.0f;
  for (int row = blockIdx.x; row < N; row += gridDim.x) {
    const float* xr = x + (long long)row * C;
    const float* gr = dy + (long long)row * C;
    const float mu = mean[row], r = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float dxhat = gr[c] * w[c];
      s1 += dxhat;
      s2 += dxhat * (xr[c] - mu) * r;
    }
    const float m1 = block_sum(s1, scratch) / C;  // mean_c dxhat_c
    const float m2 = block_sum(s2, scratch) / C;  // mean_c dxhat_c xhat_c
    float* dxr = dx + (long long)row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {  // the thread's own columns
      const float xhat = (xr[c] - mu) * r, g = gr[c];
      dxr[c] = r * (g * w[c] - m1 - xhat * m2);
      part_w[c] += g * xhat;
      part_b[c] += g;
    }
  }
  float* dw_row = dw_part + (long long)blockIdx.x * C;  // written once, after the last row
  float* db_row = db_part + (long long)blockIdx.x * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {  // the same columns: no barrier needed
    dw_row[c] = part_w[c];
    db_row[c] = part_b[c];
  }
}

extern "C" __global__ void layernorm_param_grads(const float* __restrict__ dw_part,
                                                 const float* __restrict__ db_part,
                                                 float* __restrict__ dw,
                                                 float* __restrict__ db, int G, int C) {
  __shared__ float sums_w[32][32];  // [y][x]: the column sums of thread (x, y)
  __shared__ float sums_b[32][32];
  const int x = threadIdx.x, y = threadIdx.y, R = blockDim.y;
  const int c = blockIdx.x * 32 + x;
  const bool inside = c < C;  // the last block's columns past C-1 load nothing
  float sw = 0.0f, sb = 0.0f;
  for (int g = y; inside && g < G; g += R) {  // partial rows y, y + R, ...: block order
    sw += dw_part[(long long)g * C + c];
    sb += db_part[(long long)g * C + c];
  }
  sums_w[y][x] = sw;
  sums_b[y][x] = sb;
  __syncthreads();  // every row group's sums are in shared memory
  if (y == 0 && inside) {
    float tw = 0.0f, tb = 0.0f;
    for (int i = 0; i < R; ++i) {  // in order: the same bits on every run
      tw += sums_w[i][x];
      tb += sums_b[i][x];
    }
    dw[c] = tw;
    db[c] = tb;
  }
}
