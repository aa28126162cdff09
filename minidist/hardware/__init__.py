"""Hardware: what the machine can do, and what each op of the model asks of it.

    op_costs.py       FLOPs and bytes of each op, as one fused kernel (the compulsory
                      bytes) and as the unfused passes of its NumPy twin
    roofline.py       arithmetic intensity: every op of a GPT training step (forward,
                      backward, optimizer; fused and unfused; per precision) placed under
                      a machine's compute and memory roofs (the H200's data sheet, this
                      CPU's measured rates)
    roofline_cli.py   `python -m minidist roofline`: this CPU's roofs, NumPy op timings
                      against their bounds, the table and the PNG
    profiles.py       GPUs and clusters as data (profiles/*.json: A100 40/80 GB, H100 SXM,
                      H200; peaks per format, HBM, NVLink and network per GPU, each number
                      with its source) and this machine in the same terms
    predict.py        a layout's training step at scale: step time, tokens/s, MFU and HFU,
                      its breakdown and memory per GPU, from gpt_ops' kernels, the tiered
                      collective costs, the pipeline simulator and the memory estimator
    replay.py         that model against Megatron's published runs (Tables 1 and 2): fitted
                      on 3 rows, the error on every other
    predict_cli.py    `python -m minidist predict` (and --replay)
    architecture.py   the model a prediction prices, by its shapes: minidist's GPT or a
                      Llama block (RMSNorm, SwiGLU, grouped-query attention, rotary, untied
                      head); its parameters and Megatron's tp split of them
    llama.py          the Llama 2 and 3 presets (7B-405B), each number with its source
    architecture_layout.py  an Architecture on a layout: its rules, each rank's elements
    architecture_memory.py  an Architecture's memory per GPU: Korthikanti et al.'s
                      activation count generalised to grouped-query attention and SwiGLU
    cpu_caches.py     this CPU's memory hierarchy: read GB/s and random-access ns over
                      working sets from 16 KB up, one plateau per cache level (the CPU twin
                      of gpu/kernels/bandwidth.cu and pointer_chase.cu)

Read next: hardware/op_costs.py, then hardware/roofline.py.
"""
