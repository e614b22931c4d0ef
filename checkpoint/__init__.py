"""Training state on storage: sharded snapshots and the formats that leave the run.

    snapshot_format.py  what a sharded snapshot holds (the layout, its constants)
    snapshot_writer.py  each rank writes the boxes it owns; the atomic commit
    snapshot_reader.py  opening checks everything; ranged reads by box; which one to resume
    async_snapshot.py   the writer's steps in the background (trainer.snapshot_async)
    sync_snapshot.py    the same interface without it: every rank waits for its write
    snapshot_dirs.py    the step directories' names, retention, and the checks on them
    checksums.py        CRC-32C of every MiB of a part and of the manifest, written and checked
    boxes.py            boxes of canonical tensors, the unit of sharded state
    canonical.py        the single-device names and shapes every layout reads and writes
    resume.py           where snapshots live, and whether one may be resumed by this run
    hf_gpt2.py          the Hugging Face GPT-2 folder format (config.json + safetensors)
    export.py           mode=export: a snapshot -> a Hugging Face GPT-2 folder

May import: errors, model, data (the tokenizer's identity, the data order). Nothing here
imports parallel/ or the trainer: strategies hand their pieces to snapshot_writer.py.
"""
