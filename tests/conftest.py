"""A tiny random-weight LLaMA with GQA (4 query heads, 2 KV heads): fast, seeded, and small
enough for the slow reference. Each test gets a fresh model: H2OCache switches a model's
attention implementation, and comparisons against DynamicCache want an untouched one."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_tiny_llama(dtype=torch.float32, max_position_embeddings=512, seed=0, **overrides):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.requires_grad_(False)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture
def tiny_llama64():
    """float64, for tests that compare which tokens are kept: ranking by scores that differ
    only by float32 rounding noise would make exact-set comparisons flaky."""
    return make_tiny_llama(torch.float64)
