"""Training data on storage: text sources, tokenizers, prepared token shards, the order
in which optimizer steps read windows (char_dataset.py, at the root, is the entry point
that turns them into train and val sets).

    tokenizer.py      char and gpt2 (tiktoken BPE, offline through TIKTOKEN_CACHE_DIR)
    text_chunks.py    a text source (file, directory, glob, URL) cut into chunks for prepare
    prepare.py        mode=prepare: text -> token shards, in parallel, resumable
    token_shards.py   reading prepared shards in place (memory-mapped / ranged reads)
    sampling.py       which windows each step reads; what a snapshot records of that order
    permutation.py    the keyed O(1)-per-entry permutation behind the feistel sampler
    fs_json.py        JSON objects through fsspec (atomically, for commit points)

May import: errors. Nothing here imports the model, parallel/, checkpoint/ or the trainer.
"""
