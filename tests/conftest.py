"""Shared fixtures: tiny random-weight Llama models (fast) and the real SmolLM2 (slow tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


def make_tiny_llama(path: Path, seed: int = 0, layers: int = 2, hidden: int = 64, init: float = 0.2) -> Path:
    """A random Llama with SmolLM2's tokenizer (so chat templates and stop strings work), saved to ``path``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from workers.model_loader import ensure_smollm2_converted

    src = ensure_smollm2_converted()
    tok = AutoTokenizer.from_pretrained(str(src))
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=init,  # peaky logits: greedy ties between batch shapes become vanishingly rare
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=0))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A different random model with the same vocabulary: a bad draft that must not change output."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("tinyd") / "d", seed=1, layers=1, hidden=32))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: str):
    from workers.model_loader import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_loaded():
    from workers.model_loader import load_model

    return load_model("smollm2")


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: with the 2 cores shared, intra-op threads only spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def probe(cluster):
    """A long-lived driver on the module's ``cluster`` (each end-to-end module defines its own cluster)."""
    from cluster.local_cluster import Probe

    with Probe(cluster) as p:
        yield p
