"""Pipeline parallelism: the layer stack cut into P stages, one per pp rank, micro-batches
flowing through them in the order a schedule gives.

    schedules.py           schedules as data: GPipe, 1F1B, interleaved 1F1B, zero bubble
    stage.py               PipelineCut (which layers a stage holds), the links between
                           stages, and PipelineStage, which runs a schedule's actions
    schedule_validate.py   proves a schedule complete and free of deadlock
    schedule_sim.py        its timeline, bubble and peak activations, and the closed forms
    schedule_render.py     the timeline as text, a Chrome trace or a PNG
    schedule_csv.py        a schedule written as text and read back
compose.parallelize cuts the model last; compose.build gives the stage its schedule.
Read next: schedules.py, then stage.py.
"""
