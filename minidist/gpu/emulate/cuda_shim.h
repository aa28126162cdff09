// cuda_shim.h: just enough of CUDA to run unmodified kernel source on CPU threads.
//
// The idea: a CUDA block is a team of threads that share memory and meet at barriers, and
// so are POSIX threads with a barrier. build.py compiles a .cu file with
// `g++ -std=c++20 -include cuda_shim.h`, so the kernel text is the one nvcc compiles; only
// `extern __shared__ T name[];` (dynamic shared memory) is rewritten, on its one line, into
// a pointer to the launch's buffer.
//
// One launch's view (cuda_shim::launch):
//   1. start blockDim.x*y*z threads; each sets its own threadIdx (thread_local)
//   2. every thread walks the blocks in order 0, 1, ...; for each it sets blockIdx and calls
//      the kernel, then waits at an end-of-block barrier. One block runs at a time, so a
//      `__shared__` variable can be a plain `static`: per-block storage, reused by the next
//   3. __syncthreads() is a barrier over the block's threads; a thread that returns from
//      the kernel stops counting (as on sm_70+), so `if (i >= n) return;` cannot deadlock
//   4. __shfl_*_sync: each lane writes its value to an exchange slot, the warp meets at a
//      warp barrier, each lane reads its source lane's slot (two buffers alternate, so one
//      barrier per shuffle suffices). All lanes of the warp must call it (full mask).
//   5. a thread that waits at a barrier longer than the launch's timeout (the others wait
//      at a different one) breaks the launch: every thread unwinds, the launch returns an
//      error message instead of hanging.
// Barriers are atomics (acquire/release) plus a futex to sleep on, which ThreadSanitizer
// understands: remove a __syncthreads and the accesses it ordered become a reported data
// race. Shared memory is static storage and device memory is the caller's (NumPy) heap, so
// AddressSanitizer reports a read past either. Only light headers: every kernel build pays
// for them (<atomic> alone costs 0.8 s of g++ time; the __atomic builtins cost nothing).
//
// Not emulated: memory-model weakness beyond what TSan reports, partial shuffle masks,
// cooperative groups, textures, half types, more than one block at a time.
// Reference: CUDA C++ Programming Guide, "Built-in Variables", "Synchronization Functions",
// "Warp Shuffle Functions".
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __constant__
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;              // written before the launch's threads start
constexpr int warpSize = 32;

namespace cuda_shim {

struct Broken {};                           // thrown in every thread once the launch broke

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// A reusable barrier; leave() takes a thread that returned from the kernel off the count.
// State: one word (expected << 32 | arrived) and a generation number that waiters sleep on.
// The thread that completes a generation runs on_release (while every other thread waits),
// resets `arrived`, then bumps the generation: its release and the waiters' acquire order
// everything before the barrier before everything after it (the edge TSan checks).
struct Barrier {
  unsigned full = 0;
  std::uint64_t word = 0;
  std::uint32_t gen = 0;
  bool* broken = nullptr;
  double timeout_s = 60.0;
  void (*on_release)(void*) = nullptr;
  void* arg = nullptr;

  void init(unsigned n, bool* broken_flag, double timeout) {
    full = n, word = pack(n, 0), broken = broken_flag, timeout_s = timeout;
  }
  void reset() { __atomic_store_n(&word, pack(full, 0), __ATOMIC_RELEASE); }

  void wait(const char* where) {
    const std::uint32_t g = __atomic_load_n(&gen, __ATOMIC_ACQUIRE);
    std::uint64_t w = __atomic_load_n(&word, __ATOMIC_RELAXED), next;
    do {
      next = arrived(w) + 1 >= expected(w) ? pack(expected(w), 0) : w + 1;
    } while (!__atomic_compare_exchange_n(&word, &w, next, true, __ATOMIC_ACQ_REL,
                                          __ATOMIC_RELAXED));
    if (arrived(next) == 0) return release();
    const double deadline = now_s() + timeout_s;
    while (__atomic_load_n(&gen, __ATOMIC_ACQUIRE) == g) {
      if (__atomic_load_n(broken, __ATOMIC_ACQUIRE)) throw Broken{};
      timespec ts{0, 100 * 1000 * 1000};    // wake every 0.1 s to look at `broken`
      syscall(SYS_futex, &gen, FUTEX_WAIT_PRIVATE, g, &ts, nullptr, 0);
      if (__atomic_load_n(&gen, __ATOMIC_ACQUIRE) == g && now_s() > deadline) {
        w = __atomic_load_n(&word, __ATOMIC_RELAXED);
        std::fprintf(stderr, "cuda_shim: a thread waited %.1f s at %s: %u of %u threads "
                     "arrived; the others wait elsewhere (a barrier inside a branch?)\n",
                     timeout_s, where, arrived(w), expected(w));
        __atomic_store_n(broken, true, __ATOMIC_RELEASE);
        throw Broken{};
      }
    }
  }

  void leave() {
    std::uint64_t w = __atomic_load_n(&word, __ATOMIC_RELAXED), next;
    do {
      const unsigned e = expected(w) - 1, a = arrived(w);
      next = (a > 0 && a >= e) ? pack(e, 0) : pack(e, a);
    } while (!__atomic_compare_exchange_n(&word, &w, next, true, __ATOMIC_ACQ_REL,
                                          __ATOMIC_RELAXED));
    if (arrived(w) > 0 && arrived(next) == 0) release();
  }

  static std::uint64_t pack(unsigned e, unsigned a) { return (std::uint64_t{e} << 32) | a; }
  static unsigned expected(std::uint64_t w) { return static_cast<unsigned>(w >> 32); }
  static unsigned arrived(std::uint64_t w) { return static_cast<unsigned>(w); }
  void release() {
    if (on_release) on_release(arg);
    __atomic_fetch_add(&gen, 1u, __ATOMIC_ACQ_REL);
    syscall(SYS_futex, &gen, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }
};

// What the threads of one launch share.
struct Launch {
  dim3 grid, block;
  unsigned n = 0, n_warps = 0;
  bool broken = false;
  Barrier block_barrier, done;              // __syncthreads; the end of each block
  Barrier* warps = nullptr;                 // __syncwarp and shuffles, one per warp
  std::uint64_t* exchange[2] = {nullptr, nullptr};   // one shuffle slot per thread
  unsigned char* dynamic_shared = nullptr;
  void (*body)(void*) = nullptr;            // the kernel with its arguments bound
  void* body_arg = nullptr;
};

struct Me { Launch* launch; unsigned tid, warp, lane, parity; };
inline thread_local Me me;

inline void syncthreads() { me.launch->block_barrier.wait("__syncthreads"); }
inline void syncwarp(const char* where = "__syncwarp") { me.launch->warps[me.warp].wait(where); }

// Lane `src` of this warp's value of v (v itself when src is outside the warp or segment).
template <class T>
T exchange(T v, int src, bool valid) {
  static_assert(sizeof(T) <= 8, "cuda_shim shuffles values of at most 8 bytes");
  std::uint64_t slot = 0;
  std::memcpy(&slot, &v, sizeof(T));
  std::uint64_t* buf = me.launch->exchange[me.parity];
  me.parity ^= 1u;
  const unsigned base = me.warp * 32u;
  buf[me.tid] = slot;
  syncwarp("a warp shuffle");
  if (!valid || src < 0 || base + src >= me.launch->n) return v;
  T out;
  std::memcpy(&out, &buf[base + src], sizeof(T));
  return out;
}

inline void* dynamic_shared() { return me.launch->dynamic_shared; }

inline void reset_block_barriers(void* p) {      // run by the last thread to finish a block
  Launch* L = static_cast<Launch*>(p);
  L->block_barrier.reset();
  for (unsigned w = 0; w < L->n_warps; ++w) L->warps[w].reset();
}

struct ThreadArg { Launch* launch; unsigned tid; };

inline void* thread_main(void* p) {
  ThreadArg a = *static_cast<ThreadArg*>(p);
  Launch& L = *a.launch;
  const dim3 g = L.grid, b = L.block;
  me = Me{&L, a.tid, a.tid / 32u, a.tid % 32u, 0u};
  threadIdx = dim3(a.tid % b.x, (a.tid / b.x) % b.y, a.tid / (b.x * b.y));
  const unsigned long long blocks = 1ull * g.x * g.y * g.z;
  try {
    for (unsigned long long k = 0; k < blocks; ++k) {
      blockIdx = dim3(k % g.x, (k / g.x) % g.y, k / (1ull * g.x * g.y));
      me.parity = 0;
      L.body(L.body_arg);
      L.block_barrier.leave();               // this thread has returned from the kernel
      L.warps[me.warp].leave();
      L.done.wait("the end of a block");
    }
  } catch (const Broken&) {
    __atomic_store_n(&L.broken, true, __ATOMIC_RELEASE);
  }
  return nullptr;
}

// Run body(arg) over the grid on blockDim threads; 0, or 1 with a message in err.
inline int run_grid(dim3 grid, dim3 block, std::size_t shared_bytes, double timeout_s,
                    void (*body)(void*), void* arg, char* err, std::size_t err_len) {
  static pthread_mutex_t one_launch_at_a_time = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&one_launch_at_a_time);     // static __shared__ storage is global
  gridDim = grid, blockDim = block;
  Launch L;
  L.grid = grid, L.block = block, L.body = body, L.body_arg = arg;
  L.n = block.x * block.y * block.z;
  L.n_warps = (L.n + 31) / 32;
  L.block_barrier.init(L.n, &L.broken, timeout_s);
  L.done.init(L.n, &L.broken, timeout_s);
  L.done.on_release = reset_block_barriers, L.done.arg = &L;
  L.warps = new Barrier[L.n_warps];
  for (unsigned w = 0; w < L.n_warps; ++w)
    L.warps[w].init(L.n - 32 * w < 32 ? L.n - 32 * w : 32, &L.broken, timeout_s);
  L.exchange[0] = new std::uint64_t[L.n]();
  L.exchange[1] = new std::uint64_t[L.n]();
  L.dynamic_shared = new unsigned char[shared_bytes ? shared_bytes : 1];  // as asked for
  ThreadArg* args = new ThreadArg[L.n];
  pthread_t* threads = new pthread_t[L.n];
  unsigned started = 0;
  for (; started < L.n; ++started) {
    args[started] = ThreadArg{&L, started};
    if (pthread_create(&threads[started], nullptr, thread_main, &args[started]) != 0) break;
  }
  if (started < L.n) __atomic_store_n(&L.broken, true, __ATOMIC_RELEASE);
  for (unsigned t = 0; t < started; ++t) pthread_join(threads[t], nullptr);
  const bool broken = L.broken;
  if (started < L.n)
    std::snprintf(err, err_len, "could start only %u of %u threads", started, L.n);
  else if (broken)
    std::snprintf(err, err_len, "the launch deadlocked at a barrier (see stderr)");
  delete[] threads, delete[] args, delete[] L.dynamic_shared;
  delete[] L.exchange[0], delete[] L.exchange[1], delete[] L.warps;
  pthread_mutex_unlock(&one_launch_at_a_time);
  return broken ? 1 : 0;
}

template <class... A>
int launch(void (*kernel)(A...), dim3 grid, dim3 block, std::size_t shared_bytes,
           double timeout_s, void** args, char* err, std::size_t err_len) {
  struct Bound { void (*kernel)(A...); void** args; };
  Bound bound{kernel, args};
  auto body = [](void* p) {
    Bound& b = *static_cast<Bound*>(p);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      b.kernel(*static_cast<std::remove_cvref_t<A>*>(b.args[I])...);
    }(std::index_sequence_for<A...>{});
  };
  return run_grid(grid, block, shared_bytes, timeout_s, body, &bound, err, err_len);
}

template <class T>
T atomic_add(T* address, T v) {              // a CAS loop for float and double
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, v, __ATOMIC_ACQ_REL);
  } else {
    T old, desired;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    do {
      desired = old + v;
    } while (!__atomic_compare_exchange(address, &old, &desired, true, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED));
    return old;
  }
}

}  // namespace cuda_shim

// ---- the CUDA device functions the kernels call ----
inline void __syncthreads() { cuda_shim::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_shim::syncwarp(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned __activemask() { return 0xffffffffu; }

template <class T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  const int lane = static_cast<int>(cuda_shim::me.lane);
  return cuda_shim::exchange(v, lane / width * width + src % width, true);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  const int lane = static_cast<int>(cuda_shim::me.lane), src = lane ^ mask;
  return cuda_shim::exchange(v, src, src / width == lane / width);
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(cuda_shim::me.lane), src = lane + static_cast<int>(delta);
  return cuda_shim::exchange(v, src, src / width == lane / width);
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(cuda_shim::me.lane), src = lane - static_cast<int>(delta);
  return cuda_shim::exchange(v, src, src >= 0 && src / width == lane / width);
}

template <class T>
T atomicAdd(T* address, T v) { return cuda_shim::atomic_add(address, v); }
template <class T>
T atomicMax(T* address, T v) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(address, &old, v, true, __ATOMIC_ACQ_REL,
                                                 __ATOMIC_RELAXED)) {}
  return old;
}
template <class T>
T atomicCAS(T* address, T expected, T desired) {
  __atomic_compare_exchange_n(address, &expected, desired, false, __ATOMIC_ACQ_REL,
                              __ATOMIC_RELAXED);
  return expected;
}

template <class T>
T __ldg(const T* p) { return *p; }
inline long long clock64() { return static_cast<long long>(cuda_shim::now_s() * 1e9); }
template <class A, class B>
std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B>
std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) { return __builtin_bit_cast(float, i); }
inline int __float_as_int(float f) { return __builtin_bit_cast(int, f); }
inline float __uint_as_float(unsigned i) { return __builtin_bit_cast(float, i); }
inline unsigned __float_as_uint(float f) { return __builtin_bit_cast(unsigned, f); }
