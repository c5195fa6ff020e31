"""The model a run trains: a fresh Qwen3.5-layout CausalLM with its MTP head (initialised here),
an existing checkpoint with a frozen trunk and a trainable head (distillation), or an existing
checkpoint trained whole (fine-tuning). (The chunked delta rule a run
uses is an Ops table the trainer passes down: nextn.ops.OPS.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from nextn.config.model import ModelConfig
from nextn.layers.norm import RMSNorm, RMSNormGated
from nextn.models.loader import load_model
from nextn.models.mtp import MTPHead
from nextn.models.qwen3_5 import CausalLM
from nextn.train.config import TrainConfig
from nextn.train.tokenizer import ENDOFTEXT, token_id

INIT_STD = 0.02
_RESIDUAL_OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")


@torch.no_grad()
def init_weights_(module: nn.Module, num_layers: int, seed: int) -> None:
    """GPT-style init: matrices N(0, 0.02), residual-branch outputs scaled by 1/sqrt(2 * layers);
    zero-centred norms at 0 and the GDN output norm at 1 (both start as identity scales);
    GDN decay parameters as transformers initialises them."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("A_log"):  # decay rates exp(A_log) spread over [0.01, 16]
            p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif name.endswith("conv1d.weight"):  # nn.Conv1d's default bound, fan_in = kernel width
            bound = 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
        elif p.ndim >= 2:
            std = INIT_STD / math.sqrt(2 * num_layers) if name.endswith(_RESIDUAL_OUT) else INIT_STD
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    for m in module.modules():
        if isinstance(m, RMSNormGated):
            m.weight.fill_(1.0)
        elif isinstance(m, RMSNorm):
            m.weight.zero_()


def padded_vocab(tokenizer_size: int) -> int:
    """Embedding rows: the tokenizer's size rounded up to a multiple of 64 (as Qwen pads)."""
    return -(-tokenizer_size // 64) * 64


def build_model(cfg: TrainConfig, tok, device: torch.device) -> tuple[CausalLM, dict]:
    """A fresh model of cfg.shape sized to the tokenizer -> (model, its config.json)."""
    hf_config = cfg.shape.hf_config(padded_vocab(tok.get_vocab_size()), token_id(tok, ENDOFTEXT))
    model = CausalLM(ModelConfig.from_dict(hf_config), num_mtp_layers=1)
    init_weights_(model, cfg.shape.num_hidden_layers, cfg.seed)
    return model.to(device), hf_config


def checkpoint_model(cfg: TrainConfig, device: torch.device) -> tuple[CausalLM, dict]:
    """The checkpoint's model with its MTP head (its own, or a fresh one where it has none)
    trainable in float32 and its trunk frozen (distillation) or trainable in float32 too
    (fine-tuning) -> (model, config.json of the result)."""
    src = Path(cfg.source)
    finetune = cfg.finetune_from is not None
    model = load_model(src, device=str(device), dtype="float32" if finetune else cfg.dtype)
    if model.mtp is None:
        head = MTPHead(model.cfg)
        init_weights_(head, model.cfg.num_hidden_layers, cfg.seed)
        model.mtp = head
    model.mtp.to(device=device, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(finetune or name.startswith("mtp."))
    return model, text_config(src)


def text_config(model_dir: Path) -> dict:
    """The checkpoint's config.json as a text-only export with one MTP layer (the layout the
    written checkpoint uses: trunk weights under `model.*`)."""
    raw = json.loads((model_dir / "config.json").read_text())
    if "text_config" in raw:  # released VLM layout -> text-only export
        arch = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[raw["model_type"]]
        tie = raw.get("tie_word_embeddings", raw["text_config"].get("tie_word_embeddings", False))
        raw = {**raw["text_config"], "architectures": [arch], "tie_word_embeddings": tie}
    return {**raw, "mtp_num_hidden_layers": 1}
