import importlib.util
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

TINY_QWEN3_HELPER = os.path.join(REPO_ROOT, "fixtures", "step1_trainer", "tiny_qwen3.py")


def _load_tiny_qwen3_helper():
    spec = importlib.util.spec_from_file_location("dsfix_fixture_tiny_qwen3", TINY_QWEN3_HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_qwen3_helper():
    """fixtures/step1_trainer/tiny_qwen3.py: tiny_qwen3_model(seed, dtype, ...), tiny_qwen3_tokenizer()."""
    return _load_tiny_qwen3_helper()


@pytest.fixture(scope="session")
def tiny_qwen3_tokenizer(tiny_qwen3_helper):
    """A small Qwen2TokenizerFast over a BPE trained on a few words."""
    return tiny_qwen3_helper.tiny_qwen3_tokenizer()


@pytest.fixture
def tiny_qwen3(tiny_qwen3_helper):
    """A fresh seeded narrow Qwen3ForCausalLM (28 layers, tied embeddings, 311 state-dict keys)."""
    return tiny_qwen3_helper.tiny_qwen3_model(seed=0)
