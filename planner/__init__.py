"""The planner behind `python main.py mode=plan`: which layout for this model on that cluster.

It predicts, without a process group and without training, what each layout of
`parallel/` would cost per rank and per step on a target cluster, from the same
accounting the runs report in metrics.jsonl:

    config.py    PlanConfig, the `plan:` section of gpt2_train_cfg.yaml
    machines.py  GPU presets (memory, peak FLOP/s, intra- and inter-node bandwidth)
    formulas.py  byte formulas shared with the benchmark (bench/run_engine/stats.py):
                 the ZeRO / Megatron / ring textbook volumes
    census.py    the parameters each rank holds, from the real model and TP code on
                 the meta device
    layouts.py   every layout the product runs on a world size (parallel/layout.py's
                 rules decide which are valid)
    predict.py   per rank: state bytes, activation bytes, collective bytes by kind;
                 per step: a stated time model
    report.py    ranking, the table, `plan.out` JSON; `plan(cfg)` is the mode's entry

May import: model, errors, char_dataset (the vocabulary), telemetry.mfu (peaks),
parallel (rules, schedules, TP placement, the model plan). Nothing in parallel/,
the trainer or main.py's training path imports it; bench/ does (formulas.py).
"""
