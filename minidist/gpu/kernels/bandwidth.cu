// bandwidth: read and copy sweeps, whose GB/s show the L1, L2 and HBM plateaus.
//
// The idea: with enough loads in flight, throughput is limited by the bandwidth of the
// level that serves them. bandwidth_read streams `total` float4 loads over a working set of
// (mask + 1) float4s (a power of two), wrapping with i & mask: the traffic is fixed while
// the working set grows from 16 KB to 1 GB. A set that fits in L1 (~256 KB per SM on
// Hopper, shared with shared memory) is served from each SM's L1; one under the L2
// (~50-60 MB) from L2; above that from HBM (H200: 4.8 TB/s spec). bandwidth_copy is the
// STREAM-style copy (one read, one write per element), the number the roofline uses.
//
// One thread's view (grid-stride loop; G = gridDim.x * blockDim.x threads, g = my index):
//     read: acc = sum of the 4 floats of x[i & mask] for i = g, g + G, ... < total;
//           out[g] = acc                          (one store per thread keeps the loads live)
//     copy: dst[i] = src[i] for i = g, g + G, ... < n
//
// Shapes: read: x (mask + 1,) float4 (mask + 1 a power of two), out (G,) float32,
//     total >= 0 float4 loads; copy: src, dst (n,) float4. Pointers 16-byte aligned.
// Memory traffic: read 16 * total bytes from the level holding the set (+ 4 G stored);
//     copy 32 n bytes (16 n read + 16 n written; +16 n more if stores allocate first).
// Host side: minidist/gpu/hierarchy.py (the sweep and GB/s); minidist/hardware/
//     cpu_caches.py is the CPU analogue.
// Reference: Williams, Waterman & Patterson 2009, "Roofline: an insightful visual
//     performance model for multicore architectures", CACM 52(4); McCalpin 1995, STREAM.

extern "C" __global__ void bandwidth_read(const float4* x, long long mask, long long total,
                                          float* out) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long G = (long long)gridDim.x * blockDim.x;
    float acc = 0.0f;
    for (long long i = g; i < total; i += G) {
        const float4 v = x[i & mask];
        acc += (v.x + v.y) + (v.z + v.w);
    }
    out[g] = acc;
}

extern "C" __global__ void bandwidth_copy(const float4* src, float4* dst, long long n) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long G = (long long)gridDim.x * blockDim.x;
    for (long long i = g; i < n; i += G) {
        dst[i] = src[i];
    }
}
