"""Hugging Face ``transformers`` models at the sizes people serve, built from a config with
random weights (seeded; nothing downloads), for latency and for what pgc's search and its
peers make of the library's code. Fidelity is against the same fp32 model, so random weights
do not matter for cosine; top-1 agreement on random logits is fragile (near ties), so the
ViT's accuracy column says little.

MODEL_SPECs: ``bench._hf_random:distilbert`` (4 layers, dim 512, 128 tokens, batch 1),
``bench._hf_random:vit`` (ViT-S shape: 6 layers, dim 384, 224x224 images, batch 1),
``bench._hf_random:gpt2`` (4 layers, dim 512, 64 tokens, no key-value cache, batch 1),
``bench._hf_random:resnet`` (ResNet-18 shape: basic blocks, 224x224 images, batch 1).

    pgc optimize bench._hf_random:distilbert --max-drop 0.01 --json
"""

from __future__ import annotations

from typing import Any

import torch

INPUTS = 16


def distilbert() -> dict[str, Any]:
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    model = DistilBertModel(DistilBertConfig(n_layers=4, dim=512, hidden_dim=2048, n_heads=8,
                                             vocab_size=8000)).eval()
    ids = [torch.randint(0, 8000, (1, 128)) for _ in range(INPUTS)]
    return {"model": model,
            "example_inputs": [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]}


def vit() -> dict[str, Any]:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536,
        image_size=224, patch_size=16, num_labels=100)).eval()
    images = [torch.randn(1, 3, 224, 224) for _ in range(INPUTS)]
    return {"model": model, "example_inputs": [{"pixel_values": x} for x in images]}


def gpt2() -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8000,
                                       n_positions=256, use_cache=False,
                                       bos_token_id=0, eos_token_id=0)).eval()
    ids = [torch.randint(0, 8000, (1, 64)) for _ in range(INPUTS)]
    return {"model": model, "example_inputs": [{"input_ids": x} for x in ids]}


def resnet() -> dict[str, Any]:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(
        embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
        layer_type="basic", num_labels=100)).eval()
    images = [torch.randn(1, 3, 224, 224) for _ in range(INPUTS)]
    return {"model": model, "example_inputs": [{"pixel_values": x} for x in images]}
