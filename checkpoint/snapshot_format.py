"""The snapshot format: what a sharded snapshot holds and the constants its writer
(checkpoint/snapshot_writer.py) and reader (checkpoint/snapshot_reader.py) share.
Each rank writes what it owns, in parallel; nothing is pickled.

Layout under `trainer.snapshot_path` (a directory; any fsspec URL):

    latest.json                  -> {"step_dir": "step-00000120", "snapshot_id": ...}
    step-00000120/manifest.json  step, layout, config, GPT shape, tokenizer, wandb id,
                                 and an index: which bytes of which part hold which
                                 range of which canonical tensor, with their checksums;
                                 last, the checksum of the manifest itself
    step-00000120/part-00000.bin one per rank: a 256-byte JSON header, then raw tensors

A canonical tensor is a model parameter or an AdamW state in single-device
names and shapes ("model/transformer.wte.weight", "optim/<name>/exp_avg").
A rank writes the boxes of it that it owns (checkpoint/boxes.py: a (start,
stop) range per dimension): a whole tensor for a replicated strategy, the
rows or columns of a tensor-parallel shard, the pieces of an fsdp flat
shard. Every element is written by exactly one rank, so replicated state is
written once. Format 2 stored flat ranges; it still loads, each range read
as the boxes it covers.

Checksummed (format 4; checkpoint/checksums.py): each piece's index entry
holds the CRC-32C of every MiB of its bytes, and the manifest the CRC-32C of
its own contents. Every read checks what it reads (a ranged read widens to
the MiB chunks it touches), so damage that keeps a file's size is one error
naming the file and the tensor. Formats 2 and 3 have no checksums: they load
unchecked.

Reading is by box: `SnapshotReader.read_box(key, box)` fetches only the byte
spans it needs (ranged reads also work on object stores), so a rank
resuming under another layout reads its own shard without materialising
the rest.

Atomic: parts and manifest go into a fresh step directory; only then is
latest.json replaced (write to a temporary name, rename), and step
directories beyond the newest `keep` are deleted (checkpoint/snapshot_dirs.py). A kill
at any moment leaves latest.json pointing at a complete snapshot. Safe: JSON
and raw bytes only, nothing executes on load, and every directory or file
name read from latest.json or a manifest must be a plain name of the
expected form (snapshot_dirs.checked_name), so a copied snapshot cannot send
the reader outside its directory.
"""

import torch

FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)  # 2: flat ranges instead of boxes; 2 and 3: no checksums
CHECKSUMMED_FROM = 4
HEADER_BYTES = 256
MAGIC = "mingpt-parallel-part"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64}
