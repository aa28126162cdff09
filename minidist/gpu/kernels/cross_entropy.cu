// cross_entropy: softmax cross-entropy per row, with the gradient written over the logits.
//
// Math, per row n of logits z (N, V) with target t_n (Megatron's and llm.c's fused loss):
//   m = max_v z_v,   l = sum_v exp(z_v - m),   loss_n = log(l) + m - z_{t_n}
//   dz_v = dloss * (exp(z_v - m) / l - [v == t_n])
// Rows whose target is ignore_index get loss 0 and gradient 0. dloss is dL/dloss_n, the
// same for every row: 1/count for a mean over the counted rows, 1 for a sum.
// Why fused and in place: the (N, V) logits are the largest activation of a language model
// (V ~ 50k). Computing the loss and writing the gradient over the logits in the same pass
// never materialises the (N, V) softmax, and the backward needs no second pass. The
// logits are gone afterwards: call it once the forward no longer needs them.
//
// One block's view: the block owns rows blockIdx.x, + gridDim.x, ...; for each row
//   1. thread 0 reads z_t first (the writes in step 3 will overwrite it)
//   2. ONE pass over the thread's columns v = threadIdx.x, + blockDim.x, ... keeps a running
//      max m_i and a running sum l_i of exp(z_v - m_i), rescaling l_i when the max grows
//      (the online softmax of Milakov & Gimelshein 2018, arXiv:1805.02867, Alg. 3); then a
//      block max gives m, and a block sum of l_i exp(m_i - m) gives l; thread 0 writes loss_n
//   3. each thread overwrites its columns with dz_v. The barriers inside the block
//      reductions order every read of the row (steps 1-2) before every write.
// So a row is read twice (the online pass, the gradient pass) and written once; a separate
// max pass would read it three times, and rows of V ~ 50k floats (200 KB) with ~1000 rows
// in flight do not stay in L2 between passes.
//
// Shapes: logits (N, V) row-major, in: z, out: dz; targets (N,) int32; losses (N,).
//   blockDim.x a multiple of 32, <= 1024.
// Memory traffic (compulsory, float32): read z, write dz, read t, write loss:
//   4 (2NV + 2N) B; issued 4 (3NV + 2N) B (z is read twice). The unfused sequence
//   (unfused.cu) also writes and reads exp(z - m).
// Twin: minidist/autograd/fused.py::CrossEntropy, forward and backward (float64).

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

extern "C" __global__ void cross_entropy_forward_backward(float* __restrict__ logits,
                                                          const int* __restrict__ targets,
                                                          float* __restrict__ losses, int N,
                                                          int V, float dloss,
                                                          int ignore_index) {
  __shared__ float scratch[32];
  const float neg_inf = __uint_as_float(0xff800000u);
  for (int row = blockIdx.x; row < N; row += gridDim.x) {
    float* z = logits + (long long)row * V;
    const int t = targets[row];
    const bool keep = t != ignore_index;
    const float z_t = (keep && threadIdx.x == 0) ? z[t] : 0.0f;  // before anyone writes
    float m_i = neg_inf, l_i = 0.0f;  // this thread's running max and sum of exp(z - m_i)
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      const float zv = z[v];
      if (zv > m_i) {  // a new max: rescale the sum so far (exp(-inf) = 0 on the first)
        l_i = l_i * expf(m_i - zv) + 1.0f;
        m_i = zv;
      } else if (m_i != neg_inf) {  // -inf columns before any finite one add nothing
        l_i += expf(zv - m_i);       // (expf(-inf - -inf) would be NaN)
      }
    }
    const float m = block_reduce(m_i, scratch, true);
    // a thread with no columns has l_i = 0 and m_i = -inf: its term is 0 * 0
    const float l = block_reduce(l_i > 0.0f ? l_i * expf(m_i - m) : 0.0f, scratch, false);
    if (threadIdx.x == 0) losses[row] = keep ? logf(l) + m - z_t : 0.0f;
    const float scale = keep ? dloss / l : 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
      z[v] = scale * expf(z[v] - m) - (keep && v == t ? dloss : 0.0f);
  }
}
