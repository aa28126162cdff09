"""Training under mpiexec equals training on shared memory: the same Plan, the same numbers.

Over MPI (runtime/mpi.py) a group has no shared memory, so DataParallel is the plain engine
(one all-reduce per parameter, parallel/data/ddp.py) and every collective takes a message-based
algorithm, where the spawn runtime runs the bucketed fast path and algo "direct". DDP,
ZeRO-1, tensor + sequence parallelism and a 2-stage pipeline (its send/recv through MPI) on
2 ranks must still give the single-process numbers, within float64 rounding.
By default ZeRO-1 runs; DDP, tp + SP and the pipeline are marked slow.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.runtime.launch import spawn
from minidist.train import Plan, train_on_rank
from tests.helpers import assert_close, configs, mpiexec_or_skip

pytestmark = [pytest.mark.mpi, pytest.mark.multiproc]

MPIEXEC = mpiexec_or_skip()

DATA = DataConfig(task="sort", length=4)
TINY = model_config_for(DATA, n_layer=2, n_embd=16, n_head=2, dtype="float64")
RUN = dict(steps=3, global_batch=8, lr=1e-2)

# argv: the Plan's fields as JSON, output .npz; keep the model and run in step with DATA,
# TINY and RUN
SCRIPT = textwrap.dedent("""
    import json
    import sys
    import numpy as np
    import minidist
    from minidist.data import DataConfig, model_config_for
    from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

    plan, out = Plan(**json.loads(sys.argv[1])), sys.argv[2]
    ctx = minidist.init()
    data = DataConfig(task="sort", length=4)
    cfg = model_config_for(data, n_layer=2, n_embd=16, n_head=2, dtype="float64")
    run = train_on_rank(ctx, cfg, data, plan, RunConfig(steps=3, global_batch=8),
                        OptimizerConfig(lr=1e-2))
    if ctx.rank == 0:
        np.savez(out, transport=type(ctx).__name__, losses=np.array(run.losses),
                 **{"param:" + name: p for name, p in run.params.items()})
""")


@pytest.mark.parametrize("fields", [pytest.param(dict(dp=2), marks=pytest.mark.slow),
                                    dict(dp=2, zero=1),            # default: ZeRO-1
                                    pytest.param(dict(tp=2, sequence_parallel=True),
                                                 marks=pytest.mark.slow),
                                    pytest.param(dict(pp=2, micro_batches=4, schedule="zb-h1"),
                                                 marks=pytest.mark.slow)],
                         ids=["ddp", "zero1", "tp2-sp", "pp2-zb-h1"])
def test_training_under_mpiexec_matches_the_shared_memory_run(tmp_path, fields):
    script, out = tmp_path / "mpi_train.py", tmp_path / "rank0.npz"
    script.write_text(SCRIPT)
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), json.dumps(fields),
                          str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    with np.load(out) as f:
        assert str(f["transport"]) == "MpiContext"       # really over MPI, not a 1-rank job
        losses = f["losses"]
        params = {k.split(":", 1)[1]: f[k] for k in f.files if k.startswith("param:")}

    shm = spawn(2, train_on_rank, TINY, DATA, Plan(**fields), *configs(**RUN))[0]
    ref = train_single_process(TINY, DATA, grad_accum=fields.get("micro_batches", 1), **RUN)
    what = f"{fields} under mpiexec"
    # float64: the runs add the same numbers, only the grouping over ranks may differ.
    assert_close(losses, shm.losses, atol=1e-12, what=f"{what} vs shared memory: loss")
    assert_close(losses, ref.losses, atol=1e-12, what=f"{what} vs 1 process: loss")
    assert params.keys() == shm.params.keys() == ref.params.keys()
    for name, p in params.items():
        assert_close(p, shm.params[name], atol=1e-12, what=f"{what} vs shared memory: {name}")
        assert_close(p, ref.params[name], atol=1e-12, what=f"{what} vs 1 process: {name}")
