"""Training state on storage: sharded snapshots and the formats that leave the run.

    snapshot.py       sharded snapshots: each rank writes the boxes it owns; atomic commit
    snapshot_dirs.py  the step directories' names, retention, and the checks on them
    boxes.py          boxes of canonical tensors, the unit of sharded state
    canonical.py      the single-device names and shapes every layout reads and writes
    resume.py         where snapshots live, and whether one may be resumed by this run
    hf_gpt2.py        the Hugging Face GPT-2 folder format (config.json + safetensors)
    export.py         mode=export: a snapshot -> a Hugging Face GPT-2 folder

May import: errors, model, data (the tokenizer's identity, the data order). Nothing here
imports parallel/ or the trainer: strategies hand their pieces to snapshot.py.
"""
