"""Our GPT <-> a Hugging Face GPT-2 folder (`config.json` + `model.safetensors`).

The two models compute the same function, and their parameters have the same
names (`transformer.h.0.attn.c_attn.weight`, ...). Two differences:

- HF's GPT-2 keeps its projections in `Conv1D` layers whose weight is
  (in, out), where our `nn.Linear` holds (out, in): c_attn, attn c_proj,
  c_fc and mlp c_proj are transposed on the way out and back;
- HF's GPT-2 always has biases. A `model.bias=false` model is exported with
  zero biases (the same function: a zero LayerNorm or Linear bias adds
  nothing); loading a folder into a bias=false model requires them to be
  zero, or says which is not.

config.json says `activation_function: "gelu"` (exact GELU, ours; GPT-2's
original `gelu_new` is the tanh approximation), `n_positions` = block_size,
`layer_norm_epsilon` 1e-5, tied LM head (`lm_head.weight` is not stored:
`tie_word_embeddings`), and under `mingpt_parallel` our own facts (bias,
tokenizer, and each tensor's CRC-32C, `tensor_crc32c`, which model.init_from checks
when a folder has them: checkpoint/checksums.py). model.safetensors is written and read with the safetensors library
(the format's own implementation, which transformers reads: no pickle, and
its header checks are the library's, not a copy of them). Paths may be any
fsspec URL.
"""

import json

import fsspec
import safetensors.torch
import torch

from checkpoint.checksums import tensor_crc
from errors import UserError

CONFIG, WEIGHTS = "config.json", "model.safetensors"
CHAR_VOCAB = "vocab_char.json"  # our char tokenizer's vocabulary (checkpoint/export.py)
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


# ---------------------------------------------------------------- names and shapes

def hf_shapes(gpt):
    C, V, T = gpt["n_embd"], gpt["vocab_size"], gpt["block_size"]
    per = {"ln_1.weight": (C,), "ln_1.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
           "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
           "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
           "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,),
           "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,)}
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
              "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
    for i in range(gpt["n_layer"]):
        shapes.update({f"transformer.h.{i}.{k}": s for k, s in per.items()})
    return shapes


def to_hf(state, gpt):
    """Our canonical state dict -> HF GPT-2 tensors (fp32, contiguous)."""
    out = {}
    for name, shape in hf_shapes(gpt).items():
        if name in state:
            t = state[name].detach().to(torch.float32)
            out[name] = (t.t() if name.endswith(TRANSPOSED) else t).contiguous()
        else:  # a bias of a bias=false model: zeros compute the same function
            assert name.endswith(".bias") and not gpt.get("bias", True), name
            out[name] = torch.zeros(shape)
    return out


def from_hf(tensors, gpt, where):
    """HF GPT-2 tensors -> our canonical state dict for a model of shape `gpt`. Accepts
    names with or without the `transformer.` prefix (GPT2LMHeadModel vs GPT2Model files)
    and ignores the attention-mask buffers older files carry."""
    named = {}
    for key, t in tensors.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")) and t.dim() == 4:
            continue  # causal-mask buffers (older transformers), not parameters
        named[key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"] = t
    lm_head = named.pop("lm_head.weight", None)
    want = hf_shapes(gpt)
    if "transformer.wpe.weight" in named and named["transformer.wpe.weight"].shape[0] > gpt["block_size"]:
        named["transformer.wpe.weight"] = named["transformer.wpe.weight"][:gpt["block_size"]]
    missing = sorted(set(want) - set(named))
    extra = sorted(set(named) - set(want))
    shapes = [f"{n}: {tuple(named[n].shape)} vs {want[n]}" for n in sorted(set(want) & set(named))
              if tuple(named[n].shape) != want[n]]
    if missing or extra or shapes:
        raise UserError(f"model.init_from={where} does not fit this model: "
                        + "; ".join(p for p in (f"missing {missing[:3]}" if missing else "",
                                                f"unexpected {extra[:3]}" if extra else "",
                                                f"shape {shapes[:3]}" if shapes else "") if p))
    if lm_head is not None and not torch.equal(lm_head.float(), named["transformer.wte.weight"].float()):
        raise UserError(f"model.init_from={where}: lm_head.weight differs from transformer.wte.weight; "
                        "this GPT ties them (one weight)")
    state = {}
    for name, t in named.items():
        t = t.to(torch.float32)
        t = t.t().contiguous() if name.endswith(TRANSPOSED) else t.contiguous()
        if name.endswith(".bias") and not gpt.get("bias", True):
            if t.abs().max().item() != 0:
                raise UserError(f"model.init_from={where}: {name} is not zero but model.bias=false; "
                                "set model.bias=true to load this model")
            continue
        state[name] = t
    return state


# ---------------------------------------------------------------- config.json

def hf_config(gpt, tokenizer_saved, tensors=None):
    """config.json for a model of shape `gpt` trained with the tokenizer `tokenizer_saved`
    (our saved state: its kind, and for gpt2 the sha256 of its BPE files, so that
    model.init_from reads the data with the same BPE); tensors: model.safetensors' (HF
    names), whose checksums it records. (Not in the safetensors file's metadata: the
    library writes metadata in no fixed order, and an export is the same bytes each time.)"""
    gpt2_bpe = tokenizer_saved["kind"] == "gpt2"
    eot = gpt["vocab_size"] - 1 if gpt2_bpe else None  # <|endoftext|>: the id after the merges
    ours = {"bias": bool(gpt.get("bias", True)), "tokenizer": tokenizer_saved["kind"]}
    if gpt2_bpe and tokenizer_saved.get("sha256"):
        ours["tokenizer_sha256"] = tokenizer_saved["sha256"]
    if tensors is not None:
        ours["tensor_crc32c"] = {n: tensor_crc(t) for n, t in sorted(tensors.items())}
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": gpt["vocab_size"], "n_positions": gpt["block_size"], "n_ctx": gpt["block_size"],
        "n_embd": gpt["n_embd"], "n_layer": gpt["n_layer"], "n_head": gpt["n_head"], "n_inner": None,
        "activation_function": "gelu",  # exact GELU, as nn.GELU(); GPT-2's gelu_new is tanh
        "resid_pdrop": gpt["dropout"], "embd_pdrop": gpt["dropout"], "attn_pdrop": gpt["dropout"],
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot,
        "torch_dtype": "float32",
        "mingpt_parallel": ours,
    }


def check_config(hf, gpt, where):
    """One clear error if the folder's GPT-2 is not a model of this run's shape; returns
    notes (a shorter context, GPT-2's tanh GELU)."""
    if hf.get("model_type") != "gpt2":
        raise UserError(f"model.init_from={where}: model_type is {hf.get('model_type')!r}, not gpt2")
    checks = [("n_layer", "model.n_layer"), ("n_head", "model.n_head"), ("n_embd", "model.n_embd"),
              ("vocab_size", "the tokenizer's vocabulary")]
    diff = [f"{k}={hf.get(k)} (this run: {ours} = {gpt[k]})" for k, ours in checks if hf.get(k) != gpt[k]]
    if hf.get("n_positions", 0) < gpt["block_size"]:
        diff.append(f"n_positions={hf.get('n_positions')} < data.block_size={gpt['block_size']}")
    if hf.get("n_inner") not in (None, 4 * gpt["n_embd"]):
        diff.append(f"n_inner={hf['n_inner']} (this GPT's MLP is 4 x n_embd)")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        diff.append("a different attention scaling (scale_attn_by_inverse_layer_idx / scale_attn_weights)")
    if abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        diff.append(f"layer_norm_epsilon={hf['layer_norm_epsilon']} (this GPT: 1e-05)")
    if diff:
        raise UserError(f"model.init_from={where} does not fit this model: " + "; ".join(diff))
    notes = []
    if hf.get("n_positions") > gpt["block_size"]:
        notes.append(f"note: model.init_from: using the first {gpt['block_size']} of "
                     f"{hf['n_positions']} position embeddings (data.block_size)")
    if hf.get("activation_function", "gelu") != "gelu":
        notes.append(f"note: model.init_from: the folder's model uses {hf['activation_function']}; "
                     "this GPT computes exact GELU, so its outputs differ slightly")
    return notes


# ---------------------------------------------------------------- safetensors

def write_safetensors(path, tensors):
    """{name: tensor} -> a safetensors file through the safetensors library (it sorts the
    names and aligns the data, so the same tensors give the same bytes)."""
    data = safetensors.torch.save({n: t.detach().contiguous().cpu() for n, t in tensors.items()},
                                  metadata={"format": "pt"})
    with fsspec.open(path, "wb") as f:
        f.write(data)


def read_safetensors(path):
    """{name: tensor} of a safetensors file; a damaged one is one UserError."""
    with fsspec.open(path, "rb") as f:
        data = f.read()
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # SafetensorError: a damaged header, offsets, shapes or dtypes
        raise UserError(f"{path} is not a readable safetensors file ({e})") from None
    for name, t in tensors.items():
        if t.dtype not in ST_DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {t.dtype}; expected F32, F16 or BF16")
    return tensors


# ---------------------------------------------------------------- a folder

def _join(root, name):
    return root.rstrip("/") + "/" + name


def read_folder(where):
    """(config.json dict, tensors, our char vocabulary or None) of a HF GPT-2 folder."""
    fs, root = fsspec.core.url_to_fs(where)
    for name in (CONFIG, WEIGHTS):
        if not fs.exists(_join(root, name)):
            raise UserError(f"model.init_from={where}: no {name} there (a Hugging Face GPT-2 folder "
                            "has config.json and model.safetensors; `python main.py mode=export` "
                            "writes one)")
    try:
        with fs.open(_join(root, CONFIG)) as f:
            hf = json.load(f)
    except ValueError as e:
        raise UserError(f"model.init_from={where}: config.json is not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise UserError(f"model.init_from={where}: config.json is not a JSON object")
    chars = None
    if fs.exists(_join(root, CHAR_VOCAB)):
        try:
            with fs.open(_join(root, CHAR_VOCAB)) as f:
                chars = json.load(f)["chars"]
            assert isinstance(chars, list) and all(isinstance(c, str) and len(c) == 1 for c in chars)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise UserError(f"model.init_from={where}: {CHAR_VOCAB} is damaged (expected "
                            '{"chars": [one character per token id]})') from None
    tensors = read_safetensors(_join(where, WEIGHTS))
    check_sums(where, hf, tensors)
    return hf, tensors, chars


def check_sums(where, hf, tensors):
    """model.safetensors' tensors against the CRC-32C our export recorded in config.json
    (a folder from elsewhere has none: taken as it is)."""
    sums = (hf.get("mingpt_parallel") or {}).get("tensor_crc32c")
    if sums is None:
        return
    again = "export its snapshot again (mode=export)"
    if not isinstance(sums, dict):
        raise UserError(f"model.init_from={where}: {CONFIG} is damaged (tensor_crc32c); {again}")
    bad = next((n for n in sorted(set(tensors) | set(sums))
                if n not in tensors or sums.get(n) != tensor_crc(tensors[n])), None)
    if bad is not None:
        raise UserError(f"model.init_from={where}: {_join(where, WEIGHTS)} is damaged: tensor "
                        f"{bad!r} does not match its crc32c checksum ({CONFIG}); {again}")


def tokenizer_state(hf, chars, where):
    """The tokenizer a folder's model was trained with, as data/tokenizer.py's saved state: our
    export says so in config.json (for gpt2 with its BPE's sha256); any other GPT-2 folder
    of 50257 tokens is taken to be OpenAI's GPT-2, whose BPE files have a known digest."""
    from data.tokenizer import files_sha256
    ours = hf.get("mingpt_parallel") or {}
    kind = ours.get("tokenizer")
    if kind == "char" or (kind is None and chars is not None):
        if chars is None:
            raise UserError(f"model.init_from={where}: a char-tokenizer model without {CHAR_VOCAB}")
        return {"kind": "char", "chars": "".join(chars)}
    if kind == "gpt2":
        return {"kind": "gpt2", **({"sha256": ours["tokenizer_sha256"]}
                                   if ours.get("tokenizer_sha256") else {})}
    if hf.get("vocab_size") == 50257:
        return {"kind": "gpt2", "sha256": files_sha256(None)}
    raise UserError(f"model.init_from={where}: cannot tell its tokenizer (no {CHAR_VOCAB}, "
                    f"vocab_size {hf.get('vocab_size')} is not GPT-2's 50257)")
