// adamw: one AdamW step over every parameter tensor of a model, in a single launch.
//
// Math, per element (Loshchilov & Hutter 2019, arXiv:1711.05101, Alg. 2; the bias
// corrections bc1 = 1 - b1^t and bc2 = 1 - b2^t are computed once on the host):
//   m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
//   p = p - lr ((m / bc1) / (sqrt(v / bc2) + eps) + wd p)
// Why multi-tensor: a GPT has ~10 parameter tensors per layer, many of them small (biases,
// LayerNorm weights). One launch per tensor costs a launch latency each and leaves the GPU
// mostly idle on the small ones; one launch per op of the NumPy twin (unfused.cu) also
// reads and writes m, v and p several times. Here the host cuts every tensor into chunks
// and one launch walks a table of chunks: each element of p, g, m, v is read once and p, m,
// v written once (the idea of NVIDIA Apex's multi_tensor_apply).
//
// One block's view: the block takes chunks k = blockIdx.x, + gridDim.x, ...; chunk k is the
//   table row (tensor, start, count): elements [start, start + count) of tensor `tensor`,
//   whose four arrays are params[tensor], grads[tensor], ms[tensor], vs[tensor]. The
//   block's threads stride over the chunk's elements; no shared memory, no barriers.
//
// Shapes: params, grads, ms, vs: tables of n_tensors device pointers (uint64 addresses);
//   chunks (n_chunks, 3) int64 rows (tensor, start, count); each tensor float32, any size.
// Memory traffic (compulsory, float32): read p, g, m, v and write p, m, v: 28 B per
//   parameter, plus 24 B per chunk of table.
// Twin: minidist/optim/adamw.py::adamw_step (float64), applied tensor by tensor.

extern "C" __global__ void adamw_multi_tensor(float* const* __restrict__ params,
                                              const float* const* __restrict__ grads,
                                              float* const* __restrict__ ms,
                                              float* const* __restrict__ vs,
                                              const long long* __restrict__ chunks,
                                              int n_chunks, float lr, float b1, float b2,
                                              float eps, float wd, float bc1, float bc2) {
  for (int k = blockIdx.x; k < n_chunks; k += gridDim.x) {
    const long long tensor = chunks[3 * k], start = chunks[3 * k + 1];
    const long long count = chunks[3 * k + 2];
    float* p = params[tensor] + start;
    const float* g = grads[tensor] + start;
    float* m = ms[tensor] + start;
    float* v = vs[tensor] + start;
    for (long long i = threadIdx.x; i < count; i += blockDim.x) {
      const float gi = g[i];
      const float mi = b1 * m[i] + (1.0f - b1) * gi;
      const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
      const float update = (mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * p[i];
      m[i] = mi;
      v[i] = vi;
      p[i] -= lr * update;
    }
  }
}
