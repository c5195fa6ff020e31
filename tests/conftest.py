"""Shared pytest fixtures: tiny random HF checkpoints built once per test session (see
tests/hf_fixtures.py for what each holds and the transformers oracles that go with them)."""

from __future__ import annotations

from pathlib import Path

import hf_fixtures  # tests/ is on sys.path (pytest's rootdir-relative "prepend" import mode)
import pytest


def _build(tmp_path_factory, name: str, kind: str, **kwargs) -> Path:
    return hf_fixtures.make_checkpoint(tmp_path_factory.mktemp(name), kind, **kwargs)


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory) -> Path:
    """Qwen3_5ForCausalLM text layout, tied embeddings, with MTP (seed 0)."""
    return _build(tmp_path_factory, "dense", "dense")


@pytest.fixture(scope="session")
def vlm_ckpt(tmp_path_factory) -> Path:
    """dense_ckpt's exact weights in the released Qwen3.5 VLM layout, sharded."""
    return _build(tmp_path_factory, "vlm", "dense", layout="vlm_sharded")


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory) -> Path:
    """Qwen3_5MoeForCausalLM text layout, untied, fused 3-D experts (as released), with MTP."""
    return _build(tmp_path_factory, "moe", "moe", fused_experts=True)


@pytest.fixture(scope="session")
def moe_perexpert_ckpt(tmp_path_factory) -> Path:
    """moe_ckpt's exact weights with experts stored per expert (what save_pretrained writes)."""
    return _build(tmp_path_factory, "moe_perexpert", "moe", fused_experts=False)


@pytest.fixture(scope="session")
def moe_vlm_ckpt(tmp_path_factory) -> Path:
    """moe_ckpt's exact weights in the released Qwen3.5-MoE VLM layout, sharded, fused experts."""
    return _build(tmp_path_factory, "moe_vlm", "moe", layout="vlm_sharded", fused_experts=True)


@pytest.fixture(scope="session")
def next_ckpt(tmp_path_factory) -> Path:
    """Qwen3NextForCausalLM, untied, per-expert tensors (as released), with MTP."""
    return _build(tmp_path_factory, "next", "next")


@pytest.fixture(scope="session")
def dense_fitted_ckpt(tmp_path_factory) -> Path:
    """dense_ckpt's trunk with an MTP head fitted to agree with it on hf_fixtures.FIT_PROMPTS and
    their 32-token greedy continuations, so speculative decoding there accepts drafts."""
    model_dir = _build(tmp_path_factory, "dense_fitted", "dense")
    hf_fixtures.fit_mtp_head(model_dir, [list(p) for p in hf_fixtures.FIT_PROMPTS])
    return model_dir


@pytest.fixture(scope="session")
def moe_fitted_ckpt(tmp_path_factory) -> Path:
    """moe_ckpt's trunk (fused experts) with an MTP head fitted like dense_fitted_ckpt's."""
    model_dir = _build(tmp_path_factory, "moe_fitted", "moe", fused_experts=True)
    hf_fixtures.fit_mtp_head(model_dir, [list(p) for p in hf_fixtures.FIT_PROMPTS])
    return model_dir


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """The test models are tiny: thread hand-off costs more than their math (about 10x on a busy
    2-core machine), so the whole suite runs torch with one intra-op thread."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
