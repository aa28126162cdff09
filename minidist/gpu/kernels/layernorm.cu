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
// Backward, stage 1 (layernorm_backward): the same row loop; two block sums give the two
//   means, then each thread writes dx for its columns and adds dy*xhat and dy into ITS
//   column of the block's partial row dw_part[blockIdx.x, :], db_part[blockIdx.x, :]. No
//   other thread touches that column, so no atomics are needed.
// Stage 2 (layernorm_param_grads): one thread per column adds the G partial rows in block
//   order. Deterministic: the same additions in the same order on every run.
// block_sum: each warp adds its 32 values with 5 xor-shuffles, lane 0 stores the warp's sum
//   in shared memory, and after a barrier every thread adds the warp sums in the same
//   order, so all threads hold the same bits.
//
// Shapes: x, y, dy, dx (N, C) row-major; w, b, dw, db (C,); mean, rstd (N,); dw_part,
//   db_part (G, C), G = gridDim.x of the backward. blockDim.x a multiple of 32, <= 1024.
// Memory traffic (compulsory, float32, 4 bytes a number): forward reads x, w, b and writes
//   y, mean, rstd: 4 (2NC + 2C + 2N) B. Backward reads dy, x, w, mean, rstd, writes dx,
//   and writes then reads the partials: 4 (3NC + C + 2N + 4GC) B, plus 4 * 2C for dw, db.
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
  float* dw_row = dw_part + (long long)blockIdx.x * C;  // this block's partial sums
  float* db_row = db_part + (long long)blockIdx.x * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) dw_row[c] = db_row[c] = 0.0f;
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
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float xhat = (xr[c] - mu) * r, g = gr[c];
      dxr[c] = r * (g * w[c] - m1 - xhat * m2);
      dw_row[c] += g * xhat;
      db_row[c] += g;
    }
  }
}

extern "C" __global__ void layernorm_param_grads(const float* __restrict__ dw_part,
                                                 const float* __restrict__ db_part,
                                                 float* __restrict__ dw,
                                                 float* __restrict__ db, int G, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;  // the last block's threads past column C-1
  float sw = 0.0f, sb = 0.0f;
  for (int g = 0; g < G; ++g) {  // block order: the same bits on every run
    sw += dw_part[(long long)g * C + c];
    sb += db_part[(long long)g * C + c];
  }
  dw[c] = sw;
  db[c] = sb;
}
