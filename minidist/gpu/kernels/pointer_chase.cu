// pointer_chase: one thread follows a random cycle, so each load waits for the one before.
//
// The idea: bandwidth hides latency (many loads in flight); a pointer chase exposes it. The
// array `next` holds a single random cycle over a working set (Sattolo's algorithm, built on
// the host): j = next[j] cannot start before the previous load returned, and a random order
// defeats prefetching. Time / hops is then the latency of the level of the hierarchy the
// working set fits in. Swept from 16 KB to 1 GB on a Hopper GPU the curve steps up where
// the set outgrows L1 (at most 256 KB per SM) and L2 (~50 MB), and again for the largest
// sets as TLB misses add up: roughly an order of magnitude from L1 to HBM. The ladder
// sgemm_1 .. sgemm_7 is a sequence of moves from the slow levels to the fast ones.
//
// One thread's view (grid (1), block (1); every other thread returns at once):
//     1. j = start, or *out when start is 0xffffffff (CONTINUE: on from the last run's end,
//        so that repeated runs walk round the whole cycle instead of replaying its start)
//     2. repeat hops times: j = next[j]           (one dependent global load per hop)
//     3. *out = j                                  (the result keeps the loads alive)
//
// Shapes: next (n,) uint32 with next a permutation of the slots it visits (slots may be
//     spaced out, e.g. one per 128-byte line); out (1,) uint32; hops >= 0 (int64).
// Memory traffic: hops loads of 4 bytes, each a whole cache line in practice, one at a time.
// Host side: minidist/gpu/hierarchy.py (builds the cycle, times the run on a GPU);
//     minidist/hardware/cpu_caches.py is the CPU analogue.
// Reference: Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4) (latency vs
//     bandwidth ceilings); the latency-probe method after Saavedra & Smith 1995 and
//     Wong et al. 2010, "Demystifying GPU microarchitecture through microbenchmarking".

extern "C" __global__ void pointer_chase(const unsigned int* next, long long hops,
                                         unsigned int start, unsigned int* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned int j = start == 0xffffffffu ? *out : start;  // CONTINUE: where the last run ended
    for (long long h = 0; h < hops; ++h) {
        j = next[j];  // the next address is the value just loaded: no overlap possible
    }
    *out = j;
}
