"""Interchange with Hugging Face: a kiln GPT <-> a `GPT2LMHeadModel` folder (model.safetensors +
config.json), so GPT-2 weights on a user's disk can be fine-tuned here and kiln's models used
with transformers.

The two are the same network (pre-norm blocks, tanh GELU = HF's "gelu_new", LayerNorm eps 1e-5,
fused q|k|v projection); only the storage differs:
  - HF names carry a `transformer.` prefix (and `lm_head.weight`, omitted when tied);
  - HF's Conv1D stores [in, out] where kiln's Linear stores [out, in] (as torch.nn.Linear), so
    c_attn, c_proj and c_fc weights are transposed;
  - kiln's vocabulary may be padded (50257 -> 50304 for GEMM shapes). `export_hf` writes the
    padded size by default: config.json says vocab_size 50304 honestly and the round trip is
    lossless; the padded rows' logits are those of tokens no tokenizer emits. With
    `vocab_size=50257` it slices the embedding to that many rows instead (logits of the kept
    tokens unchanged). `import_hf(pad_vocab_to=64)` pads an imported vocabulary with zero rows;
  - a kiln model without biases (bias=False) exports zero biases, which HF's GPT-2 always has.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from kiln.checkpoint.format import CheckpointError, atomic_file
from kiln.paths import file_inside, output_folder

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_HF_SIZES = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all tanh-approximate GELU


def hf_config(cfg, vocab_size: int | None = None, dtype: str = "float32", eot_id: int | None = None) -> dict:
    """The config.json of a GPT2LMHeadModel equal to a kiln GPTConfig; eot_id is the tokenizer's
    end-of-text id (default: GPT-2's 50256 when the vocabulary holds it), generate's stop token."""
    v = vocab_size or cfg.vocab_size
    eot = eot_id if eot_id is not None else (50256 if v > 50256 else None)
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": v,
            "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
            "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,  # kiln's attention has no dropout on its probabilities
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "use_cache": True, "bos_token_id": eot, "eos_token_id": eot,
            "tie_word_embeddings": cfg.tie_weights, "dtype": dtype, "torch_dtype": dtype,
            "kiln_padded_vocab_size": cfg.vocab_size}


def gpt_config_from_hf(hf: dict, vocab_size: int | None = None):
    """The kiln GPTConfig of an HF GPT-2 config.json; a setting kiln does not implement is a
    CheckpointError naming it."""
    from kiln.nn import GPTConfig
    if hf.get("model_type") != "gpt2":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; kiln imports 'gpt2'")
    for key in _HF_SIZES:
        if key not in hf:
            raise CheckpointError(f"config.json has no {key!r}; a GPT-2 config.json gives {', '.join(_HF_SIZES)}")
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise CheckpointError(f"config.json has activation_function {act!r}; kiln's GELU is the tanh "
                              f"approximation: allowed {', '.join(_GELU_TANH)}")
    for key, allowed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                         ("add_cross_attention", False)):
        if hf.get(key, allowed) != allowed:
            raise CheckpointError(f"config.json has {key}={hf[key]!r}; kiln's GPT-2 needs {allowed}")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise CheckpointError(f"config.json has n_inner={hf['n_inner']}; kiln's MLP is 4 x n_embd "
                              f"= {4 * hf['n_embd']}")
    if abs(float(hf.get("layer_norm_epsilon", 1e-5)) - 1e-5) > 1e-12:
        raise CheckpointError(f"config.json has layer_norm_epsilon={hf['layer_norm_epsilon']}; kiln uses 1e-05")
    return GPTConfig(vocab_size=vocab_size or hf["vocab_size"], block_size=hf["n_positions"],
                     n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                     dropout=float(hf.get("resid_pdrop", 0.0)), bias=True,
                     tie_weights=bool(hf.get("tie_word_embeddings", True)))


def carried_dropout(hf: dict) -> str:
    """What an HF config's dropout settings become in kiln, in words: resid_pdrop is kiln's one
    dropout (embeddings, attention and MLP outputs); attn_pdrop has no place in kiln's attention."""
    p, attn = float(hf.get("resid_pdrop", 0.0)), float(hf.get("attn_pdrop", 0.0))
    said = f"dropout {p:g} (resid_pdrop) carried into fine-tuning"
    if float(hf.get("embd_pdrop", p)) != p:
        said += f"; embd_pdrop {hf['embd_pdrop']:g} is not carried: kiln uses {p:g} for the embeddings too"
    if attn:
        said += f"; attn_pdrop {attn:g} is not carried: kiln's attention has no dropout on its probabilities"
    return said + ("; fine-tune with --set dropout=0 for none" if p else "")


def to_hf_tensors(model, vocab_size: int | None = None, dtype: str | None = None) -> dict:
    """{HF name: NumPy array} of a kiln GPT (on any device)."""
    cfg = model.config
    v = vocab_size or cfg.vocab_size
    if not 0 < v <= cfg.vocab_size:
        raise CheckpointError(f"export vocab_size {v}: allowed 1..{cfg.vocab_size} (the model's)")
    out = {}
    for name, p in model.named_parameters():
        a = np.asarray(p.numpy())
        if name.endswith(_CONV1D):
            a = a.T
        if name in ("wte.weight", "lm_head.weight"):
            a = a[:v]
        if dtype is not None:
            a = a.astype(dtype)
        out[name if name == "lm_head.weight" else "transformer." + name] = np.ascontiguousarray(a)
    if not cfg.bias:  # HF's GPT-2 always has biases: zeros are the same function
        n, zeros = cfg.n_embd, (lambda k: np.zeros(k, dtype=out["transformer.wte.weight"].dtype))
        for i in range(cfg.n_layer):
            h = f"transformer.h.{i}."
            for key, size in (("ln_1.bias", n), ("ln_2.bias", n), ("attn.c_attn.bias", 3 * n),
                              ("attn.c_proj.bias", n), ("mlp.c_fc.bias", 4 * n), ("mlp.c_proj.bias", n)):
                out[h + key] = zeros(size)
        out["transformer.ln_f.bias"] = zeros(n)
    return out


def export_hf(model, out_dir, vocab_size: int | None = None, dtype: str | None = None,
              tokenizer_dir=None, overwrite: bool = False) -> Path:
    """Write `model` as a GPT2LMHeadModel folder: model.safetensors (HF names, Conv1D layout) and
    config.json; with tokenizer_dir, its tokenizer file is copied too. Returns the folder. A folder
    that holds anything already is refused unless `overwrite` (its files of the same names are replaced)."""
    from safetensors.numpy import save as st_save
    out = output_folder(out_dir, "the export folder")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"export folder {str(out)!r} exists and is not empty; choose a new one or "
                              "pass overwrite=True (--overwrite) to replace its config.json and weights")
    tensors = to_hf_tensors(model, vocab_size, dtype)
    out.mkdir(parents=True, exist_ok=True)
    dt = str(tensors["transformer.wte.weight"].dtype)
    with atomic_file(out / HF_WEIGHTS) as f:
        f.write(st_save(tensors, metadata={"format": "pt"}))  # transformers wants format "pt"
    tok = _tokenizer_of(tokenizer_dir)
    config = hf_config(model.config, vocab_size, dt, None if tok is None else tok.eot_id)
    with atomic_file(out / HF_CONFIG) as f:
        f.write(json.dumps(config, indent=2).encode())
    if config["eos_token_id"] is not None:  # transformers' generate stops there
        with atomic_file(out / "generation_config.json") as f:
            f.write(json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
                               indent=2).encode())
    _copy_tokenizer(tokenizer_dir, out)
    if tok is not None and tok.kind == "bpe" and tok.eot_token is not None:  # what AutoTokenizer reads
        with atomic_file(out / "tokenizer_config.json") as f:
            f.write(json.dumps({"tokenizer_class": "GPT2TokenizerFast", "bos_token": tok.eot_token,
                                "eos_token": tok.eot_token, "unk_token": tok.eot_token,
                                "model_max_length": model.config.block_size}, indent=2).encode())
    return out


def _tokenizer_of(folder):
    """The tokenizer saved in `folder`, or None when it has none."""
    from kiln.data.tokenizer import BPE_FILE, BYTES_FILE, load_tokenizer
    if folder is None or not any((Path(folder) / name).is_file() for name in (BPE_FILE, BYTES_FILE)):
        return None
    return load_tokenizer(folder)


def _copy_tokenizer(src, dst) -> None:
    """tokenizer.json (which transformers reads too) or kiln's bytes-tokenizer.json, if src has one."""
    for name in ("tokenizer.json", "bytes-tokenizer.json"):
        if src is not None and (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


def read_hf_tensors(folder) -> dict:
    """{name: NumPy array} of an HF folder's model.safetensors (or its shards)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    folder = Path(folder)
    if (folder / HF_WEIGHTS).is_file():
        files = [folder / HF_WEIGHTS]
    elif (folder / HF_INDEX).is_file():
        try:
            weight_map = json.loads((folder / HF_INDEX).read_bytes().decode("utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{folder / HF_INDEX}: not an index of safetensors files "
                                  f'({{"weight_map": {{tensor: file}}}}): {e!r}') from None
        files = [file_inside(folder, name, str(folder / HF_INDEX), CheckpointError) for name in names]
    else:
        other = [p.name for p in folder.glob("*.bin")] if folder.is_dir() else []
        raise CheckpointError(f"{folder} holds no {HF_WEIGHTS} (or {HF_INDEX})"
                              + (f"; it has {other}: kiln reads safetensors only, convert with "
                                 "transformers' save_pretrained(safe_serialization=True)" if other else ""))
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file: {e}") from None
    return tensors


def from_hf_tensors(tensors: dict, cfg) -> dict:
    """{kiln name: array} from HF GPT-2 tensors, checked against the kiln config `cfg`."""
    out = {}
    for name, a in tensors.items():
        key = name.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old GPT-2 files store the causal mask as a buffer
        if key == "lm_head.weight" and cfg.tie_weights:
            continue  # tied: the same tensor as wte.weight
        if key.endswith(_CONV1D):
            a = a.T
        out[key] = np.ascontiguousarray(a)
    return out


def import_hf(folder, pad_vocab_to: int | None = None, device: str = "cpu", dtype: str = "float32"):
    """A kiln GPT with the weights of an HF GPT-2 folder; pad_vocab_to=64 rounds the vocabulary up
    to a multiple of 64 with zero rows (GEMM-friendly, as the paper's 50304)."""
    from kiln.errors import KilnError
    from kiln.nn import GPT
    folder = Path(folder)
    try:
        hf = json.loads((folder / HF_CONFIG).read_text())
    except OSError:
        raise CheckpointError(f"{folder} holds no {HF_CONFIG}: not a Hugging Face model folder") from None
    except ValueError as e:
        raise CheckpointError(f"{folder / HF_CONFIG} is not JSON: {e}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{folder / HF_CONFIG} holds a {type(hf).__name__}, not a JSON object")
    gpt_config_from_hf(hf)  # a missing or unsupported setting is named before anything is read
    v = hf["vocab_size"]
    if pad_vocab_to:
        v = -(-v // pad_vocab_to) * pad_vocab_to
    cfg = gpt_config_from_hf(hf, vocab_size=v)
    weights = from_hf_tensors(read_hf_tensors(folder), cfg)
    for key in ("wte.weight", "lm_head.weight"):
        if key in weights and weights[key].shape[0] < v:
            w = weights[key]
            weights[key] = np.concatenate([w, np.zeros((v - w.shape[0], w.shape[1]), w.dtype)])
    model = GPT(cfg)
    model.to(dtype=dtype)
    try:
        model.load_state_dict(weights)
    except KilnError as e:
        raise CheckpointError(f"{folder}: the weights do not match its config.json "
                              f"({dataclasses.asdict(cfg)}): {e}") from None
    return model.to(device)


def import_hf_run(hf_dir, run_dir, pad_vocab_to: int | None = None) -> Path:
    """A kiln run folder (config.json, model.safetensors, the tokenizer file if the HF folder has
    one) from an HF GPT-2 folder: `kiln sample` reads it, `kiln train --init-from` fine-tunes it."""
    from kiln.checkpoint.run_folder import WEIGHTS, save_weights, write_config
    model = import_hf(hf_dir, pad_vocab_to=pad_vocab_to)
    run = output_folder(run_dir, "--out")
    if run.exists() and any(run.iterdir()):
        raise CheckpointError(f"--out {run}: the folder exists and is not empty; choose a new one")
    run.mkdir(parents=True, exist_ok=True)
    save_weights(run / WEIGHTS, model)
    write_config(run, model.config, None, imported_from=str(Path(hf_dir).resolve()))
    _copy_tokenizer(hf_dir, run)
    return run
