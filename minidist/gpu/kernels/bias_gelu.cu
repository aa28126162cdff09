// bias_gelu: y = gelu(x + bias) in one pass, and its backward with dbias by a two-stage sum.
//
// Math, tanh GeLU as GPT-2 (Hendrycks & Gimpel 2016, arXiv:1606.08415, Sec. 2):
//   u = x + bias[c],   k = sqrt(2/pi) (u + 0.044715 u^3),   t = tanh(k)
//   y = u (1 + t) / 2
//   dy/du = (1 + t) / 2 + u (1 - t^2) / 2 * sqrt(2/pi) (1 + 3 * 0.044715 u^2)
// x is a matmul's output without its bias: adding the bias here, in the same pass, is what
// saves the unfused version's (N, C) round trip of u (unfused.cu: add_bias, then gelu).
//
// One thread's view (forward): elements i = global thread index, + total threads, ...
//   (grid-stride), column c = i % C; load x[i] and bias[c], store y[i]. No shared memory.
// Backward, stage 1 (bias_gelu_backward): the grid is 2-D. blockIdx.x picks a tile of
//   blockDim.x columns, blockIdx.y a group of rows (blockIdx.y, + gridDim.y, ...). Each
//   thread owns one column: for each of its rows it writes dx = dy * dy/du and adds dx to a
//   register; at the end it stores the register in dbias_part[blockIdx.y, c]. Neighbouring
//   threads touch neighbouring columns, so every row access is coalesced.
// Stage 2 (bias_gelu_dbias): one thread per column adds the gridDim.y partial rows in
//   order: deterministic, no atomics.
//
// Shapes: x, y, dy, dx (N, C) row-major; bias, dbias (C,); dbias_part (G, C), G = gridDim.y.
// Memory traffic (compulsory, float32): forward reads x, bias, writes y: 4 (2NC + C) B.
//   Backward reads dy, x, bias, writes dx, writes and reads the partials, writes dbias:
//   4 (3NC + 2GC + 2C) B. The unfused forward moves 4 (4NC + C) B: about twice as much.
// Twin: minidist/autograd/fused.py::Gelu(approximate="tanh") of x + bias (float64).

__device__ __forceinline__ float gelu_tanh(float u, float* dgelu) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2/pi), the cubic's weight
  const float t = tanhf(k0 * (u + k1 * u * u * u));
  *dgelu = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * k0 * (1.0f + 3.0f * k1 * u * u);
  return 0.5f * u * (1.0f + t);
}

extern "C" __global__ void bias_gelu_forward(const float* __restrict__ x,
                                             const float* __restrict__ bias,
                                             float* __restrict__ y, long long n, int C) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float unused;
    y[i] = gelu_tanh(x[i] + bias[i % C], &unused);
  }
}

extern "C" __global__ void bias_gelu_backward(const float* __restrict__ dy,
                                              const float* __restrict__ x,
                                              const float* __restrict__ bias,
                                              float* __restrict__ dx,
                                              float* __restrict__ dbias_part, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;  // the last tile's threads past column C-1
  const float bc = bias[c];
  float acc = 0.0f;
  for (int row = blockIdx.y; row < N; row += gridDim.y) {
    const long long i = (long long)row * C + c;
    float dgelu;
    gelu_tanh(x[i] + bc, &dgelu);
    const float g = dy[i] * dgelu;
    dx[i] = g;
    acc += g;
  }
  dbias_part[(long long)blockIdx.y * C + c] = acc;
}

extern "C" __global__ void bias_gelu_dbias(const float* __restrict__ dbias_part,
                                           float* __restrict__ dbias, int G, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int g = 0; g < G; ++g) s += dbias_part[(long long)g * C + c];
  dbias[c] = s;
}
