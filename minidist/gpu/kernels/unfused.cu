// unfused: the fused kernels' computations as sequences of simple kernels, one step each.
//
// This is how a framework without fusion runs them: every NumPy-like op is one launch
// that reads its inputs from global memory and writes its output back. Each step is easy
// to read and to check, and each costs a launch and a round trip of an (N, C)-sized
// intermediate. gpu/fused.py runs both versions; their launch counts and the bytes they
// move are what kernel fusion saves (counted there and in hardware/roofline.py).
//
// The sequences (gpu/unfused.py, the fused op's namesake):
//   LayerNorm forward     row_mean, row_rstd, normalize, scale_shift          4 launches
//   LayerNorm backward    column_multiply, row_mean, row_subtract, multiply,  11
//                         row_mean, row_multiply, subtract, row_multiply,
//                         multiply, column_sum (dw), column_sum (db)
//   bias + GeLU forward   add_bias, gelu_forward                              2
//   bias + GeLU backward  add_bias, gelu_backward, column_sum                 3
//   causal softmax        scale_mask, row_max, exp_sub, row_sum, row_divide   5
//   softmax backward      row_dot, softmax_grad                               2
//   cross-entropy         row_max, exp_sub, row_sum, ce_loss, ce_grad         5
//   AdamW                 adam_moments, adam_param per tensor                 2 per tensor
//   attention             attn_scores, the causal softmax above, attn_apply   7
//
// One thread's view: an elementwise kernel takes elements i = global index, + all
// threads, ... (grid-stride); a row kernel gives one thread a whole row (R rows -> R
// threads: simple, and slow for long rows: that is the point of the fused versions).
//
// Shapes: as in the fused files: (N, C) activations, (R, L) rows of scores or logits,
//   (BH, T, D) attention heads, all row-major float32; targets int32.
// Memory traffic: each kernel reads its inputs and writes its output once; e.g. the
//   LayerNorm sequence moves 4 (6NC + 2C + 5N) B against the fused 4 (2NC + 2C + 2N) B.
//   The LayerNorm backward is the twin's eleven NumPy passes (autograd/fused.py,
//   LayerNorm.backward, given the forward's xhat and rstd), one kernel each, exactly as
//   hardware/op_costs.py counts them: 4 (21NC + 3C + 5N) B against the fused
//   4 (3NC + 3C + 2N) B plus its partial sums.
// Twins: the same as the fused kernels (minidist/gpu/twins.py).

#define GRID_STRIDE(i, n)                                                         \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float gelu_tanh(float u, float* dgelu) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2/pi), the cubic's weight
  const float t = tanhf(k0 * (u + k1 * u * u * u));
  *dgelu = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * k0 * (1.0f + 3.0f * k1 * u * u);
  return 0.5f * u * (1.0f + t);
}

// ---- row reductions: one thread per row of length L ----
extern "C" __global__ void row_mean(const float* x, float* mean, int R, int L) {
  GRID_STRIDE(r, R) {
    float s = 0.0f;
    for (int c = 0; c < L; ++c) s += x[r * L + c];
    mean[r] = s / L;
  }
}

// rstd = 1 / sqrt(var + eps), var the mean square of the row minus its mean
extern "C" __global__ void row_rstd(const float* x, const float* mean, float* rstd, int R,
                                    int L, float eps) {
  GRID_STRIDE(r, R) {
    float s = 0.0f;
    for (int c = 0; c < L; ++c) s += (x[r * L + c] - mean[r]) * (x[r * L + c] - mean[r]);
    rstd[r] = rsqrtf(s / L + eps);
  }
}

extern "C" __global__ void row_max(const float* x, float* m, int R, int L) {
  GRID_STRIDE(r, R) {
    float best = x[r * L];
    for (int c = 1; c < L; ++c) best = fmaxf(best, x[r * L + c]);
    m[r] = best;
  }
}

extern "C" __global__ void row_sum(const float* x, float* s, int R, int L) {
  GRID_STRIDE(r, R) {
    float acc = 0.0f;
    for (int c = 0; c < L; ++c) acc += x[r * L + c];
    s[r] = acc;
  }
}

extern "C" __global__ void row_dot(const float* a, const float* b, float* d, int R, int L) {
  GRID_STRIDE(r, R) {
    float acc = 0.0f;
    for (int c = 0; c < L; ++c) acc += a[r * L + c] * b[r * L + c];
    d[r] = acc;
  }
}

extern "C" __global__ void column_sum(const float* x, float* out, int R, int L) {
  GRID_STRIDE(c, L) {
    float acc = 0.0f;
    for (int r = 0; r < R; ++r) acc += x[(long long)r * L + c];
    out[c] = acc;
  }
}

// ---- elementwise: one thread per element of an (R, L) array, n = R * L ----
// (out may be one of the inputs: each thread reads and writes only its own elements)
extern "C" __global__ void normalize(const float* x, const float* mean, const float* rstd,
                                     float* xhat, long long n, int L) {
  GRID_STRIDE(i, n) xhat[i] = (x[i] - mean[i / L]) * rstd[i / L];
}

extern "C" __global__ void scale_shift(const float* xhat, const float* w, const float* b,
                                       float* y, long long n, int L) {
  GRID_STRIDE(i, n) y[i] = xhat[i] * w[i % L] + b[i % L];
}

extern "C" __global__ void multiply(const float* a, const float* b, float* out, long long n) {
  GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}

extern "C" __global__ void subtract(const float* a, const float* b, float* out, long long n) {
  GRID_STRIDE(i, n) out[i] = a[i] - b[i];
}

// out = a * w, w (L,) one number per column
extern "C" __global__ void column_multiply(const float* a, const float* w, float* out,
                                           long long n, int L) {
  GRID_STRIDE(i, n) out[i] = a[i] * w[i % L];
}

// out = a * m and out = a - m, m (R,) one number per row
extern "C" __global__ void row_multiply(const float* a, const float* m, float* out,
                                        long long n, int L) {
  GRID_STRIDE(i, n) out[i] = a[i] * m[i / L];
}

extern "C" __global__ void row_subtract(const float* a, const float* m, float* out,
                                        long long n, int L) {
  GRID_STRIDE(i, n) out[i] = a[i] - m[i / L];
}

extern "C" __global__ void add_bias(const float* x, const float* bias, float* u, long long n,
                                    int L) {
  GRID_STRIDE(i, n) u[i] = x[i] + bias[i % L];
}

extern "C" __global__ void gelu_forward(const float* u, float* y, long long n) {
  float unused;
  GRID_STRIDE(i, n) y[i] = gelu_tanh(u[i], &unused);
}

extern "C" __global__ void gelu_backward(const float* dy, const float* u, float* du,
                                         long long n) {
  float dgelu;
  GRID_STRIDE(i, n) {
    gelu_tanh(u[i], &dgelu);
    du[i] = dy[i] * dgelu;
  }
}

// s = scale * x, and -inf where causal and column j = e % L is after the row's query
// position i = (e / L) % L (rows of (BH, T, T) scores, L = T)
extern "C" __global__ void scale_mask(const float* x, float* s, long long n, int L,
                                      float scale, int causal) {
  const float neg_inf = __uint_as_float(0xff800000u);
  GRID_STRIDE(e, n) s[e] = (!causal || e % L <= (e / L) % L) ? scale * x[e] : neg_inf;
}

extern "C" __global__ void exp_sub(const float* x, const float* m, float* e, long long n,
                                   int L) {
  GRID_STRIDE(i, n) e[i] = expf(x[i] - m[i / L]);
}

extern "C" __global__ void row_divide(const float* e, const float* s, float* y, long long n,
                                      int L) {
  GRID_STRIDE(i, n) y[i] = e[i] / s[i / L];
}

extern "C" __global__ void softmax_grad(const float* dy, const float* y, const float* d,
                                        float* dx, long long n, int L, float scale) {
  GRID_STRIDE(i, n) dx[i] = scale * y[i] * (dy[i] - d[i / L]);
}

// ---- cross-entropy from row max m, exps e = exp(z - m) and their row sums s ----
extern "C" __global__ void ce_loss(const float* z, const float* m, const float* s,
                                   const int* t, float* losses, int R, int L,
                                   int ignore_index) {
  GRID_STRIDE(r, R) {
    losses[r] = t[r] == ignore_index ? 0.0f : logf(s[r]) + m[r] - z[r * L + t[r]];
  }
}

extern "C" __global__ void ce_grad(const float* e, const float* s, const int* t, float* dz,
                                   long long n, int L, float dloss, int ignore_index) {
  GRID_STRIDE(i, n) {
    const long long r = i / L;
    const bool keep = t[r] != ignore_index;
    dz[i] = keep ? dloss * (e[i] / s[r] - (i % L == t[r] ? 1.0f : 0.0f)) : 0.0f;
  }
}

// ---- AdamW, one tensor at a time, moments and parameters in separate passes ----
extern "C" __global__ void adam_moments(const float* g, float* m, float* v, long long n,
                                        float b1, float b2) {
  GRID_STRIDE(i, n) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
  }
}

extern "C" __global__ void adam_param(float* p, const float* m, const float* v, long long n,
                                      float lr, float eps, float wd, float bc1, float bc2) {
  GRID_STRIDE(i, n) p[i] -= lr * ((m[i] / bc1) / (sqrtf(v[i] / bc2) + eps) + wd * p[i]);
}

// ---- attention with materialised (BH, T, T) scores ----
extern "C" __global__ void attn_scores(const float* q, const float* k, float* s, int BH, int T,
                                       int D) {
  GRID_STRIDE(e, (long long)BH * T * T) {  // e = (h, i, j)
    const long long h = e / ((long long)T * T), i = (e / T) % T, j = e % T;
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc += q[(h * T + i) * D + d] * k[(h * T + j) * D + d];
    s[e] = acc;
  }
}

extern "C" __global__ void attn_apply(const float* p, const float* v, float* o, int BH, int T,
                                      int D) {
  GRID_STRIDE(e, (long long)BH * T * D) {  // e = (h, i, d)
    const long long h = e / ((long long)T * D), i = (e / D) % T, d = e % D;
    float acc = 0.0f;
    for (int j = 0; j < T; ++j) acc += p[(h * T + i) * T + j] * v[(h * T + j) * D + d];
    o[e] = acc;
  }
}
