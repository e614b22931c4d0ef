"""The planner behind `python main.py mode=plan`: which layout for this model on that cluster.

It predicts, without a process group and without training, what each layout of
`parallel/` would cost per rank and per step on a target cluster, from the same
accounting the runs report in metrics.jsonl:

    config.py    PlanConfig, the `plan:` section of gpt2_train_cfg.yaml
    machines.py  GPU presets (memory, peak FLOP/s, intra- and inter-node bandwidth)
    formulas.py  byte formulas shared with the benchmark (bench/run_engine/stats.py):
                 the ZeRO / Megatron / ring textbook volumes
    census.py    the parameters each rank holds, from the real model and TP code on
                 the meta device (mixture-of-experts blocks: E / ep experts each)
    layouts.py   every layout the product runs on a world size, parallel.ep too for a
                 model with experts (parallel/layout.py's rules decide which are valid);
                 report.py adds, per fsdp layout, hybrid sharding across nodes where it
                 is faster and offload where nothing fits
    shapes.py    Layout (the config keys a run takes), Workload (model, batch,
                 precision), the micro-batch and element sizes every count uses
    stages.py    what a rank holds: its pipeline stage's parameters, fsdp's flat units
    memory.py    per rank: state bytes, activation bytes (per schedule), the peak need
    traffic.py   per rank: bytes each dimension's collectives move, by kind
    efficiency.py the kernels' and collectives' seconds from the shapes (the constants)
    step_time.py per step: the stated time model (compute, bubble, links), MFU
    published_runs.py published training runs the time model is checked against
    residuals.py how far off it was on them, by kind (generated; printed beside a prediction)
    figures.py   the fullest rank's figures, under metrics.jsonl's names
    report.py    ranking, the table, `plan.out` JSON; `plan(cfg)` is the mode's entry
    dryrun.py    mode=dryrun: a layout's first step on a few ranks of the planned world,
                 in this process under the fake backend, measured beside memory.py

May import: model, errors, char_dataset (the vocabulary), telemetry.mfu (peaks),
parallel (rules, schedules, TP placement, the model plan); dryrun.py also the trainer
and the activation meter (it runs a real step). Nothing in parallel/, the trainer or
main.py's training path imports the planner; bench/ does (formulas.py).
"""
