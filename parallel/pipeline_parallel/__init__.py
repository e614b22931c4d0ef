"""The pipeline-parallel dimension (`parallel.pp`, `pp_schedule`, `microbatches`, ...).

    pipeline.py   cuts the model to this rank's chunks and executes a schedule over
                  point-to-point sends; the tied embedding's group; busy / idle time
    schedules/    one file per schedule: a list of (F|B|W, chunk, micro-batch) per rank;
                  the registry, chunk placement (loop or V) and the layout rules
    split_backward.py  B (input gradient) and W (weight gradients) apart, for zb1p / zbv
    p2p_plan.py   when each send and receive is posted (the batching NCCL needs)
    simulator.py  runs those plans under gloo's and NCCL's rules (deadlock-free), and
                  in the textbook's unit time (the bubble each schedule should have)
    clock.py      action start / end on the device's timeline

May import: parallel/'s root files (model_plan, grid, precision) only.
"""
