"""Memory: activation recomputation, mixed precision, offloading and the memory budget.

`--recompute none|selective|full` (`memory/recompute.py`): `full` keeps only each block's
input and runs the block again in the backward (Chen et al. 2016); `selective` keeps q, k
and v and rebuilds only the attention weights, the T^2 terms (Korthikanti et al. 2022). Both
give bitwise the loss, gradients and trained parameters of no recomputation, with dropout
and MoE on, single process and under dp, ZeRO 1-3, tp (+sp), pp, ep and cp (full): dropout
masks follow the global sample index and MoE routing statistics are counted once. Kept bytes
per layer equal the formula (bench model, 4 layers, C=256, T=128, batch 8, float32: none
25.2 MB, selective 21.0 MB, full 1.05 MB). `python -m minidist bench recompute` prints the
extra compute: selective +3.0 to +6.2 % of a step (target <= 5 %; met on the quieter runs),
full 0.95-1.06 extra forwards, with an allocator that reuses freed memory (glibc's default
makes "none" pay page faults for its 100 MB graph).

`python -m minidist memory --model gpt3-13b --plan dp=2,pp=4,zero=1,recompute=selective,
precision=bf16` (`memory/budget.py`) prints a plan's bytes per rank by category (parameters,
gradients, optimizer state, activations, ZeRO's transient buffers, what a recomputing
backward rebuilds), for any dp x tp(+sp) x pp x cp x ZeRO x recompute x precision;
`--measure` runs one step of the plan on real ranks (the tiny GPT) and prints measured
beside estimated: equal to the byte for all 30 plans of the test matrix, every category.
`--fit --device-memory 141GB --gpus 8` lists the plans under which a model fits, least
traffic per step first (GPT-3 13B, batch 8 x 2048: 103 of 107 plans fit; 175B: none, 16 Psi
/ 8 = 349 GB). It reproduces ZeRO's Fig. 1 (Psi = 7.5B, N = 64, K = 12: 120, 31.4, 16.6, 1.9
GB); its helper `budget.korthikanti_layer_bytes` reproduces Korthikanti et al.'s
per-layer activation formula with its tp, tp+sp and selective variants (Table 2). The
estimate itself counts the tensors minidist saves, which are not the paper's (float32
or float64 activations, masks of its own; budget.py lists each term), so its activation
bytes differ from Table 2's. Sizes: GB = 10^9, GiB = 2^30 (an H200's 141 GB is decimal).

The device-memory ledger (`memory/ledger.py`, `--device-memory 64MB`): every array a rank
would hold on a device, counted once by its base buffer from registration until CPython
frees it, in six categories (parameters, gradients, optimizer state, communication buffers,
activations saved for backward, temporaries); current and peak bytes, a per-step timeline,
and the live set at the peak (replayed from an event log, so a new peak copies nothing).
Parameters, gradients and optimizer state equal `engine.memory()` exactly for DDP and ZeRO
1-3. Past the budget a rank raises `DeviceOutOfMemory`, naming the category that crossed it,
the bytes per category, the five largest live arrays and the fixes (`--recompute`, `--zero`,
a smaller micro-batch, offloading, more memory). With it the main job's `mem` column is the
step's peak, activations included. Its hooks chain with the FLOP ledger's and the trace's,
and cost about 2x on the tiny test model (off by default). Note: this autograd keeps every
intermediate output until the graph is dropped, so "temporaries" exceed the saved
activations (227 kB against 194 kB on dp=2, 2 layers).

`--precision bf16|fp16|fp8 [--grad-reduce fp32|low]` (`memory/precision.py`,
`master_weights.py`, `mixed_precision.py`, `loss_scale.py`, `fp8.py`; the `precision`
extra, ml_dtypes): NumPy has no fast bf16 matmul, so the formats are emulated exactly
where they round: matmul inputs and outputs are rounded to the format (E4M3 forward and E5M2
gradients with per-tensor delayed scaling for fp8), the products run in fp32; softmax,
log-softmax, LayerNorm and the loss run on fp32 copies. fp32 master weights and AdamW's m
and v (K = 12 bytes per parameter) sit in a wrapper around any engine on any layout,
sharded as ZeRO shards them; fp16 uses GradScaler's
dynamic loss scaling (2^16, x2 after 2000 good steps, x0.5 and a skipped step on inf/NaN,
the flag all-reduced so one rank's inf skips the step everywhere). `--grad-reduce low` sums
gradients in the 16-bit format: half the dp bytes (52,416 against 104,832 per step on the
test model). After 100 steps of the synthetic task, bf16 and fp16 end within 5 % of fp32's
loss drop and fp8 within 8 % (worst of 8 seeds: 1.5, 1.2, 2.6 %); demo 20 prints the curves
and the loss scale around an injected overflow. Refused for now: tp, pp, cp, ep
and recomputation.

`--offload host|disk [--offload-dir D]` (`memory/offload.py`, ZeRO-Offload and
ZeRO-Infinity's NVMe tier): the optimizer state (and under ZeRO-3 the parameter shards)
leaves the device ledger for host memory or `numpy.memmap` files; the optimizer updates the
host copy, and on the disk tier a worker thread reads the next parameter's state while the
current one is updated. The run equals the plain run bitwise (DDP and ZeRO 0-3, host and
disk), and the ledger's device peak drops by exactly the bytes moved (314 kB under ZeRO-3 in
demo 21). The files live in a per-run 0700 directory under a lock and are removed on close;
a run killed with SIGKILL leaves its directory, which the next run sweeps (its owner is
dead). On this machine host and "device" are the same RAM and the disk tier goes through the
page cache, so the step-time cost shows the mechanics, not PCIe or NVMe: `python -m minidist
bench offload` (2 layers, C=64, dp=2, a loaded machine) 1.11-1.15x (ZeRO-0) and 0.98-1.01x
(ZeRO-3) of the plain step against the 1.3x target; one disk run under ZeRO-3 at load 20+
read 1.53x.

Reading order: ledger.py (every device array a rank holds, by category), recompute.py
(activation recomputation, full and selective), precision.py (bf16 / fp16 / fp8: what is
rounded where), loss_scale.py (fp16's dynamic loss scaling), fp8.py (E4M3 / E5M2 with
delayed scaling), fp8_recipes.py (tensorwise, rowwise, blockwise, MXFP8),
master_weights.py (the fp32 master copy), mixed_precision.py (it, autocast and loss
scaling around any engine), offload.py (optimizer state and parameters to host memory or
disk), budget_models.py and budget.py (the per-rank estimate, checked against measured
bytes).
Each module is imported where it is used; this package imports none of them.
"""
