"""`python main.py mode=export export.path=DIR`: a snapshot -> a Hugging Face GPT-2 folder.

Reads the snapshot at trainer.snapshot_path (the newest, or trainer.resume_step)
through snapshot_reader.SnapshotReader, which gives canonical names and full shapes
whatever layout wrote it (fsdp shards, TP slices, pipeline stages), and writes

    config.json          GPT-2's config (hf_gpt2.hf_config), with each tensor's CRC-32C
    model.safetensors    the weights, HF's layout (hf_gpt2.to_hf)
    vocab.json, merges.txt, tokenizer_config.json
                         data.tokenizer=gpt2, when tiktoken's cached encoder.json and
                         vocab.bpe (the same content) are on this machine
    vocab_char.json      data.tokenizer=char: the characters, id = position
    README.md            what this is, how to load it and decode its ids

so that `transformers.GPT2LMHeadModel.from_pretrained(DIR)` gives our logits.
Nothing here depends on the run's identity (step, paths): exporting the same
weights twice gives the same bytes (the round trip through model.init_from
is tested to be bitwise).
"""

import hashlib
import json
import os
import tempfile

import fsspec

from checkpoint import hf_gpt2
from errors import UserError
from model import GPT, GPTConfig
from checkpoint.snapshot_reader import open_snapshot
from data.tokenizer import GPT2_FILES, files_sha256
from checkpoint.resume import snapshot_location

# HF's names for tiktoken's two GPT-2 files (the same content)
HF_NAMES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}


def export(cfg):
    """mode=export. Returns the lines to print."""
    path = snapshot_location(cfg.trainer)
    snap = open_snapshot(path, cfg.trainer.resume_step)
    if snap is None:
        raise UserError(f"no snapshot at {path} to export: train first, or set trainer.snapshot_path")
    gpt = snap.meta["gpt_config"]
    if gpt.get("moe_experts", 0):
        raise UserError("mode=export writes the Hugging Face GPT-2 format, which has no "
                        "mixture-of-experts blocks: this snapshot's model has "
                        f"model.moe_experts={gpt['moe_experts']}; use mode=sample with it")
    names = [n for n, _ in GPT(GPTConfig(**gpt)).named_parameters()]
    state = {n: snap.read_full(f"model/{n}") for n in names}
    kind = snap.meta["tokenizer"]["kind"]
    out = cfg.export.path
    try:
        fs, root = fsspec.core.url_to_fs(out)
        if fs.exists(root) and (not fs.isdir(root) or fs.ls(root)):
            # files left from another export would be read with this one (vocab_char.json)
            raise UserError(f"export.path={out} exists and is not an empty directory: export "
                            "into a new or empty one")
        fs.makedirs(root, exist_ok=True)
        write_folder(out, state, gpt, snap.meta["tokenizer"])
    except OSError as e:  # a path under a file, no permission, a full disk, ...
        raise UserError(f"cannot write export.path={out}: {type(e).__name__}: {e}") from None
    notes = [f"exported step {snap.meta['step']} of {path} ({len(names)} tensors, "
             f"{sum(t.numel() for t in state.values()) / 1e6:.2f}M parameters) to {out}"]
    if kind == "gpt2" and not fs.exists(root + "/vocab.json"):
        notes.append("note: tiktoken's cache here has no gpt2 files (encoder.json, vocab.bpe) "
                     "with the sha256 this snapshot was trained with, so no tokenizer files were "
                     "written; point TIKTOKEN_CACHE_DIR at them and export again, or, for OpenAI's "
                     "GPT-2 BPE, load GPT2TokenizerFast.from_pretrained('gpt2')")
    return notes


def write_folder(out, state, gpt, tokenizer_saved):
    """Our canonical state + its gpt_config and tokenizer state -> the folder at `out`."""
    kind = tokenizer_saved["kind"]
    tensors = hf_gpt2.to_hf(state, gpt)
    with fsspec.open(_join(out, hf_gpt2.CONFIG), "w") as f:  # with the tensors' checksums
        json.dump(hf_gpt2.hf_config(gpt, tokenizer_saved, tensors), f, indent=2)
        f.write("\n")
    hf_gpt2.write_safetensors(_join(out, hf_gpt2.WEIGHTS), tensors)
    if kind == "char":
        with fsspec.open(_join(out, hf_gpt2.CHAR_VOCAB), "w") as f:
            json.dump({"chars": list(tokenizer_saved["chars"])}, f, ensure_ascii=False)
    elif copy_gpt2_tokenizer(out, tokenizer_saved.get("sha256")):
        with fsspec.open(_join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": gpt["block_size"],
                       "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                       "unk_token": "<|endoftext|>", "add_prefix_space": False}, f, indent=2)
    with fsspec.open(_join(out, "README.md"), "w") as f:
        f.write(readme(gpt, kind))


def copy_gpt2_tokenizer(out, expected_sha256):
    """Copy tiktoken's cached encoder.json / vocab.bpe as HF's vocab.json / merges.txt
    (the same files). False if they are not cached here (nothing is downloaded), or are
    not the BPE the snapshot was trained with (a snapshot from before the digest was
    recorded takes what is cached)."""
    # tiktoken's cache names each file by the sha1 of its download URL (docs/data.md, "GPT-2's BPE offline")
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
        os.path.join(tempfile.gettempdir(), "data-gym-cache")
    sources = {name: os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
               for name, (url, _) in GPT2_FILES.items()}
    if not all(os.path.isfile(p) for p in sources.values()):
        return False
    files = {}
    for name, src in sources.items():
        with open(src, "rb") as f:
            files[name] = f.read()
    if expected_sha256 and files_sha256(files) != expected_sha256:
        return False
    for name, data in files.items():
        with fsspec.open(_join(out, HF_NAMES[name]), "wb") as g:
            g.write(data)
    return True


def readme(gpt, kind):
    size = f"{gpt['n_layer']} layers, {gpt['n_head']} heads, width {gpt['n_embd']}, " \
           f"context {gpt['block_size']}, vocabulary {gpt['vocab_size']}"
    text = (f"# A GPT-2 trained with minGPT-parallel\n\n{size}"
            f"{'' if gpt.get('bias', True) else '; trained without biases (model.bias=false): the biases here are zeros'}.\n\n"
            "```python\nfrom transformers import GPT2LMHeadModel\n"
            "model = GPT2LMHeadModel.from_pretrained(\"THIS_DIRECTORY\")\n```\n\n"
            f"The context is {gpt['block_size']} tokens (`n_positions`): the model has no position "
            f"past it, so prompt and generated tokens together must stay within {gpt['block_size']} "
            f"(`model.generate(ids, max_length={gpt['block_size']})`), or feed it only the last "
            f"{gpt['block_size']} tokens at each step, as minGPT-parallel's `mode=sample` does.\n\n"
            "`activation_function` is `gelu` (exact GELU, as trained), not GPT-2's `gelu_new`.\n"
            "minGPT-parallel fine-tunes from this folder with `model.init_from=THIS_DIRECTORY`.\n\n")
    if kind == "char":
        text += ("## Decoding\n\nThe model reads characters: token id *i* is the *i*-th character of "
                 "the list in `vocab_char.json` (no tokenizer class needed):\n\n"
                 "```python\nimport json\nchars = json.load(open(\"vocab_char.json\"))[\"chars\"]\n"
                 "stoi = {c: i for i, c in enumerate(chars)}\n"
                 "ids = [stoi[c] for c in \"Hello\"]          # encode\n"
                 "text = \"\".join(chars[i] for i in ids)     # decode\n```\n")
    else:
        text += ("## Decoding\n\nGPT-2's byte-pair encoding (tiktoken's `gpt2` = Hugging Face's "
                 "`gpt2` tokenizer): `GPT2TokenizerFast.from_pretrained(THIS_DIRECTORY)` when "
                 "`vocab.json` and `merges.txt` are here, else `from_pretrained(\"gpt2\")`.\n")
    return text


def _join(root, name):
    return root.rstrip("/") + "/" + name


def file_digest(path):
    """sha256 of a file (tests: a round trip is bitwise)."""
    with fsspec.open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
