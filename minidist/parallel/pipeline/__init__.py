"""Pipeline parallelism: the layer stack cut into P stages, one per pp rank, micro-batches
flowing through them in the order a schedule gives.

The stages. With pp > 1 the layers are cut into pp stages (stage.py; the embedding on the
first, the final LayerNorm, head and loss on the last; uneven splits by default, e.g. 5
layers on 2 stages as 3 + 2, or Plan.layers_per_stage), each cut from the same (seed, name)
draw, each parameter under its single-process name. With tied embeddings wte lives on the
first and the last stage, and their gradients are summed between the two every step
(Megatron's embedding group): the copies stay bitwise equal.

The schedules are plain data (schedules.py): for each stage, the list of its actions in
order, F(m, c) forward of micro-batch m through chunk c, B(m, c) its backward (only the
input gradient where the stage also runs W(m, c)), W(m, c) the weight gradient
(autograd/split.py cuts a backward in two, bitwise equal to one backward), and FB, a
forward of one micro-batch overlapped with the backward of another (DualPipe's F&B). The
sends and receives are derived from the actions, never written. Which chunk holds which
piece of the model is the placement: "loop" (chunk c of stage s is piece c P + s), "v"
(down the stages and back up: stage 0 holds the first and the last piece) or "dual" (stage
s holds piece s and its mirror's, P-1-s; half the micro-batches flow each way).
family.py names them all, with what each needs and claims:

    schedule      order on stage s                 bubble (unit costs)     activations held
    gpipe         all M forwards, then all M       (P-1)/(M+P-1)           M on every stage
                  backwards
    1f1b          P-1-s forwards, then one F one   (P-1)/(M+P-1)           P-s on stage s
                  B, then the remaining Bs
    interleaved   V chunks per stage (default 2),  (P-1)/(V M+P-1),        more, smaller
                  Megatron's order                 M >= P                  chunks
    zb-h1         1F1B's order with B split from   (P-1)/(3M+P-1), M >= P  P on every stage
                  W; the Ws fill the bubbles       (F = B = W)
    zb-h2         ZB-H1 with the warm-up doubled   the same for one step;  2P-1
                                                   0 when steps overlap
    zb-1p, zb-2p  the list scheduler under P or    as zb-h1, zb-h2         P, 2P at most
                  2P micro-batches held (schedule_auto.py; uneven costs welcome)
    zbv           the same on the V placement      0.06-0.23 x 1F1B's      P (in 2P halves)
                                                   when steps overlap
    v-half,       a building block repeated every  under 1/2, 2/3 of       P/2 + 1, ~P/3 + 1
    v-min         6 passes, on the V placement     1F1B's
                  (controllable_memory.py)
    dualpipe      DeepSeek-V3's two-way order,     (P/2-1)(F&B+B-3W)       P+1; every
                  overlapped F&B pairs             (Table 2)               parameter twice
    dualpipev     DualPipe cut in half, on a V     the same, PP = 2P       2P+1 halves

A schedule of your own is a CSV file like torchtitan's (schedule_csv.py), one line per
stage, cells {virtual stage}{F|B|W}{micro-batch} (an overlapped pair: 0F4&1B1):
    0F0,0F1,0B0,0B1
    1F0,1B0,1F1,1B1
(`python -m minidist train --pp 2 --grad-accum 2 --schedule my.csv --check` runs it.)
Before any process starts, schedule_validate.validate proves a schedule complete and free
of deadlock: every action present once, each B after its F and each W after its B, on every
link the sender's messages in the order the receiver expects them, and a step-by-step run
that cannot get stuck; otherwise a ScheduleError names the first stuck action.
schedule_sim.simulate(schedule, costs) plays it with F, B, W costs (per stage if you like)
and gives its timeline, bubble fraction and peak activations; schedule_render draws any
timeline, simulated or recorded from a real run (RankResult.pipeline["timeline"]), as text,
as a Chrome trace and, with the `plot` extra, as a PNG:

    stage 0 |F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7 |
    stage 1 |.  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7 |
    stage 2 |.  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7 |
    stage 3 |.  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7 |
    (ZB-H1, P = 4, M = 8, unit costs: bubble 1/9; `python -m minidist demo pipeline`.)

On the ranks each action runs as the schedule says; activations and gradients travel on
2-rank link groups with asynchronous sends, every message a numbered send/recv tagged with
its micro-batch: a message of another micro-batch is a CollectiveMismatch naming both
(DeepSpeed #5729), a hung stage a CollectiveTimeout naming the pending receive. The dp
reduction (DDP, ZeRO-1, ZeRO-2) starts after the stage's last backward (under DualPipe
after the two copies' gradients are summed between mirrors); ZeRO-3 with pp is
refused, as DeepSpeed does (it would gather every unit again for each micro-batch). Under
mpiexec a send runs inline (one thread talks to MPI): fine below MPI's eager limit.

    schedules.py           schedules as data: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2;
                           the placements, the FB action
    schedule_auto.py       the zero-bubble list scheduler under a memory limit (ZB-1p,
                           ZB-2p, ZBV)
    controllable_memory.py V-Half and V-Min from their building blocks
    dualpipe.py            DualPipe and DualPipeV
    family.py              every schedule by name: what it needs and claims
    stage.py               PipelineCut (which layers a stage holds), the links between
                           stages, and PipelineStage, which runs a schedule's actions (and
                           sums DualPipe's mirrored copies' gradients)
    schedule_validate.py   proves a schedule complete and free of deadlock
    schedule_sim.py        its timeline, bubble and peak activations, and the closed forms
    schedule_render.py     the timeline as text, a Chrome trace or a PNG
    schedule_csv.py        a schedule written as text and read back
compose.parallelize cuts the model last; compose.build gives the stage its schedule.
Read next: schedules.py, then stage.py.
"""
