"""Data parallelism: W replicas of the model, each on 1/W of every global batch, their
gradients summed before the same update on every rank.

    ddp.py       DataParallel: the algorithm as a learner expects it, one all-reduce per
                 parameter, overlapped with the backward (read this first)
    buckets.py   BucketedDataParallel: the fast path, gradients kept in shared-memory
                 buckets and summed in place; the same bits (tests/parallel/data/)
    diloco.py    DiLoCo: H local steps per replica, then an outer Nesterov step on the
                 replicas' mean progress; 1/H of DDP's bytes (not an exact method)
    onebit_adam.py  OneBitAdam: Adam's momentum sent as signs and a scale with error
                 feedback after a warm-up; about 1/32 of DDP's bytes (not exact)
    powersgd.py  PowerSGD: each gradient matrix summed as a rank-r factorisation with
                 error feedback; r (n + m) numbers for n x m (exact at full rank)
compose.gradient_sync chooses between them (Plan.textbook() forces ddp.py). Either sends
2 (W-1)/W of the gradient bytes per rank and step with the ring (collectives/cost.py
predicts each algorithm's time).
Read next: ddp.py.
"""
