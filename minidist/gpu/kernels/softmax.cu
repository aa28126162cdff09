// softmax: scaled, causal-masked softmax over attention scores, forward and backward.
//
// Math, per row r of the (R, T) score matrix, R = B*H*T, query position i = r % T:
//   m = max_{j <= i} s x_j,   y_j = exp(s x_j - m) / sum_{j' <= i} exp(s x_j' - m) (j <= i)
//   y_j = 0 for j > i (the future is masked), s = the scale, 1/sqrt(D) in attention
// Backward (dy/dx_k = s y_j (delta_jk - y_k) on the unmasked part):
//   dx_j = s y_j (dy_j - sum_k dy_k y_k),   0 where y_j = 0
// Why fused: scale, mask, max, exp, sum and divide are one pass over the row here; the
// unfused sequence (unfused.cu) writes and re-reads the (R, T) matrix after each step.
//
// One block's view: the block owns rows blockIdx.x, + gridDim.x, ...; for each row
//   1. each thread takes the max over its columns j = threadIdx.x, + blockDim.x, ... with
//      j <= i; block_max -> m (finite: column 0 is never masked)
//   2. each thread adds exp(s x_j - m) over the same columns; block_sum -> l
//   3. each thread writes y_j = exp(s x_j - m) / l for j <= i and 0 after
// Backward: block_sum of dy_j y_j, then dx_j for each thread's columns.
// block_max / block_sum: warp shuffles, one shared slot per warp, a barrier, and every
// thread combines the warp results in the same order (layernorm.cu has the long version).
//
// Shapes: x, y, dy, dx (R, T) row-major, R = B*H*T. blockDim.x a multiple of 32, <= 1024.
// Memory traffic (compulsory, float32): forward reads x, writes y: 8RT B; backward reads
//   dy, y, writes dx: 12RT B. (The masked half still costs its write of zeros.)
// Twin: minidist/autograd/fused.py::Softmax on the masked, scaled scores (float64).

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum (is_max = false) or max of v over the block, to every thread; scratch: 32 floats.
__device__ float block_reduce(float v, float* scratch, bool is_max) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  v = is_max ? warp_max(v) : warp_sum(v);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();  // every warp's result is in scratch
  float total = scratch[0];
  for (int i = 1; i < n_warps; ++i) total = is_max ? fmaxf(total, scratch[i]) : total + scratch[i];
  return total;
}

extern "C" __global__ void softmax_forward(const float* __restrict__ x, float* __restrict__ y,
                                           int R, int T, float scale) {
  __shared__ float scratch[32];
  const float neg_inf = __uint_as_float(0xff800000u);
  for (int row = blockIdx.x; row < R; row += gridDim.x) {
    const int i = row % T;  // the query position: columns j <= i are visible
    const float* xr = x + (long long)row * T;
    float m = neg_inf;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, scale * xr[j]);
    m = block_reduce(m, scratch, true);
    float l = 0.0f;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) l += expf(scale * xr[j] - m);
    const float inv_l = 1.0f / block_reduce(l, scratch, false);
    float* yr = y + (long long)row * T;
    for (int j = threadIdx.x; j < T; j += blockDim.x)
      yr[j] = j <= i ? expf(scale * xr[j] - m) * inv_l : 0.0f;
  }
}

extern "C" __global__ void softmax_backward(const float* __restrict__ dy,
                                            const float* __restrict__ y,
                                            float* __restrict__ dx, int R, int T,
                                            float scale) {
  __shared__ float scratch[32];
  for (int row = blockIdx.x; row < R; row += gridDim.x) {
    const long long base = (long long)row * T;
    float d = 0.0f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) d += dy[base + j] * y[base + j];
    d = block_reduce(d, scratch, false);  // sum_k dy_k y_k
    for (int j = threadIdx.x; j < T; j += blockDim.x)
      dx[base + j] = scale * y[base + j] * (dy[base + j] - d);
  }
}
