"""The pipeline-parallel dimension (`parallel.pp`, `pp_schedule`, `microbatches`, ...).

    pipeline.py   cuts the model to this rank's chunks and executes a schedule over
                  point-to-point sends; the tied embedding's group; busy / idle time
    schedules.py  each schedule as a list of (F|B, chunk, micro-batch) per rank; the
                  simulator that proves them deadlock-free; the layout rules

May import: parallel/'s root files (model_plan, grid, precision) only.
"""
