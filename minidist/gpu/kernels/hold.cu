// hold: one thread spins for a given number of clock cycles, keeping the GPU's queue busy.
//
// Why: a CUDA event recorded on an idle GPU completes at once, so the host time spent
// between it and the first kernel (Python, argument packing, allocations) lands inside the
// measurement. gpu/timing.py launches `hold` first, records the start event behind it and
// enqueues the K timed calls while it spins: if the host is done before the hold ends,
// every timed kernel was already waiting in the queue and the event pair brackets GPU work
// only (nvbench's "blocking kernel" idea, with a fixed spin instead of a host flag).
//
// One thread's view (grid (1), block (1)): read clock64() until `cycles` have passed.
// Shapes: none; cycles >= 0 (SM clock cycles; the host calibrates cycles per ms).
// Memory traffic: none.
// Host side: minidist/gpu/timing.py (Timer).

extern "C" __global__ void hold(long long cycles) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
