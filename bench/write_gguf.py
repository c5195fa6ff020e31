"""GGUF files of nextn's model shapes with random weights, written as llama.cpp's converter writes a
Qwen3.5 / Qwen3-Next checkpoint, so llama.cpp and nextn run the same file (issue 49's comparison).

Owns the forward direction of nextn.models.gguf's inverse: a checkpoint's tensors (Hugging Face
names, text layout, experts fused as transformers 5 holds them) -> llama.cpp's tensor names, values
and storage types, written with gguf's own writer. Names come from gguf's TensorNameMap (llama.cpp's
own table; the NextN block's from its TENSOR_NAMES), the value changes by hand from
convert_hf_to_gguf.py (each with its class at `gguf_tensors`), because llama.cpp's converter needs a
checkpoint on disk and transformers; the tests write their tiny checkpoints through this too
(tests/test_gguf.py), so the reader is checked against llama.cpp's layout, not against itself.

Random weights are drawn a tensor at a time on the device (nextn.models.random_weights's
distributions), changed and quantized there, and written raw: a first pass over meta tensors gives
the writer every tensor's shape and type, a second draws and writes them one by one, so host memory
holds one tensor. Q8_0 bytes: llama.cpp's Q8_0 (a float16 scale max|x|/127 and 32 int8 per block,
rounded half away from zero as gguf.quants does), nextn.ops.q8_0's quantizer (`q8_0_bytes`).
The vocabulary: nextn.gguf_tokenizer.write_vocab from a tokenizer directory (bench/qwen_tokenizer.py's).

  python bench/write_gguf.py --preset qwen3.5-9b --type q8_0 --tokenizer .tok/qwen3.5 --out 9b-q8_0.gguf
  python bench/write_gguf.py --config tiny/config.json --type f32 --out tiny.gguf --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: nextn from this tree
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from tqdm import tqdm  # noqa: E402

from nextn.config.model import ModelConfig  # noqa: E402
from nextn.ops.q8_0 import q8_0_quantize, q8_0_to_blocks  # noqa: E402

ARCH_OF = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
_FILE_TYPES = {
    T.F32: gguf.LlamaFileType.ALL_F32,
    T.F16: gguf.LlamaFileType.MOSTLY_F16,
    T.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}
# _Qwen35MtpMixin.modify_tensors: mtp.* outside its decoder layer -> block n_layers' NextN tensors
_NEXTN = {
    "fc": gguf.MODEL_TENSOR.NEXTN_EH_PROJ,
    "pre_fc_norm_embedding": gguf.MODEL_TENSOR.NEXTN_ENORM,
    "pre_fc_norm_hidden": gguf.MODEL_TENSOR.NEXTN_HNORM,
    "norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}


def _reorder_v_heads(t: torch.Tensor, dim: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: V heads grouped by key head -> tiled."""
    dim %= t.dim()
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _v_reorder(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """_LinearAttentionVReorderBase.modify_tensors (qwen35, qwen35moe) on a linear_attn tensor."""
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    r, q = nv // nk, 2 * nk * dk
    if ".in_proj_qkv." in name or ".conv1d" in name:  # only the V rows / channels
        return torch.cat([t[:q], _reorder_v_heads(t[q:], 0, nk, r, dv)])
    if ".in_proj_z." in name:
        return _reorder_v_heads(t, 0, nk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
        return _reorder_v_heads(t, 0, nk, r, 1)
    if ".out_proj." in name:
        return _reorder_v_heads(t, 1, nk, r, dv)
    return t


def gguf_tensors(name: str, t: torch.Tensor, cfg: ModelConfig, tensor_map) -> list[tuple[str, torch.Tensor]]:
    """One checkpoint tensor as convert_hf_to_gguf.py writes it: [(GGUF name, values)], before the
    squeeze and storage type of ModelBase.prepare_tensors (`storage_type`)."""
    arch, n = ARCH_OF[cfg.family], cfg.num_hidden_layers
    if name.startswith("mtp."):  # _Qwen35MtpMixin.modify_tensors
        if name.startswith("mtp.layers.0."):
            name = f"model.layers.{n}." + name.removeprefix("mtp.layers.0.")
        else:
            stem = name.removeprefix("mtp.").removesuffix(".weight")
            value = t + 1 if stem != "fc" else t  # Qwen3NextModel: every *norm.weight + 1
            return [(gguf.TENSOR_NAMES[_NEXTN[stem]].format(bid=n) + ".weight", value)]
    if arch != "qwen3next" and cfg.linear_num_key_heads != cfg.linear_num_value_heads and "linear_attn." in name:
        t = _v_reorder(name, t, cfg)
    # Qwen3NextModel.modify_tensors
    if name.endswith(".A_log"):
        t = -torch.exp(t.float())
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t.float() + 1
    if "in_proj_qkvz.weight" in name:  # [q k v z] per key head -> attn_qkv [q all | k all | v all], attn_gate [z all]
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        rv = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
        q, k, v, z = t.view(nk, -1, t.shape[-1]).split([dk, dk, rv, rv], dim=1)
        qkv = torch.cat([p.reshape(-1, t.shape[-1]) for p in (q, k, v)])
        block = name.split(".")[2]
        return [(f"blk.{block}.attn_qkv.weight", qkv), (f"blk.{block}.attn_gate.weight", z.reshape(-1, t.shape[-1]))]
    if name.endswith("mlp.experts.gate_up_proj"):  # Qwen2MoeModel.modify_tensors: split on dim -2
        base = name.removesuffix(".gate_up_proj")
        gate, up = t.chunk(2, dim=-2)
        return [
            (_mapped(f"{base}.gate_proj.weight", tensor_map), gate),
            (_mapped(f"{base}.up_proj.weight", tensor_map), up),
        ]
    if name.endswith("mlp.experts.down_proj"):
        name += ".weight"
    return [(_mapped(name, tensor_map), t)]


def _mapped(name: str, tensor_map) -> str:
    new = tensor_map.get_name(key=name, try_suffixes=(".weight", ".bias"))
    if new is None:
        raise ValueError(f"llama.cpp's tensor map has no name for {name}")
    return new


def storage_type(gguf_name: str, shape: tuple[int, ...], hf_name: str, qtype: T) -> T:
    """ModelBase.prepare_tensors: 1-D tensors, norms, routers, conv1d and biases in F32; Q8_0 where
    the rows are whole blocks of 32 (else gguf's QuantError and F16, as the converter falls back)."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not hf_name.endswith((".weight", "_proj")):
        return T.F32
    if gguf_name.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight")):
        return T.F32
    if qtype == T.Q8_0 and shape[-1] % 32:
        return T.F16
    return qtype


def q8_0_bytes(t: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 blocks of t [..., K] (K a multiple of 32) as uint8 [..., K / 32 * 34]: nextn's
    own quantizer (nextn.ops.q8_0, gguf.quants' Q8_0 bit for bit) in GGUF's byte order."""
    rows = t.reshape(-1, t.shape[-1])
    return q8_0_to_blocks(q8_0_quantize(rows)).reshape(*t.shape[:-1], -1)


def stored(t: torch.Tensor, qtype: T) -> np.ndarray:
    """The bytes the writer stores (F32 / F16 as arrays, BF16 and Q8_0 as uint8 rows)."""
    if qtype == T.F32:
        return t.float().cpu().numpy()
    if qtype == T.F16:
        return t.half().cpu().numpy()
    if qtype == T.BF16:
        return t.bfloat16().view(torch.uint8).reshape(*t.shape[:-1], -1).cpu().numpy()
    return q8_0_bytes(t).cpu().numpy()


def _stored_shape(shape: tuple[int, ...], qtype: T) -> tuple[tuple[int, ...], np.dtype]:
    if qtype in (T.F32, T.F16):
        return shape, np.dtype(np.float32 if qtype == T.F32 else np.float16)
    return gguf.quant_shape_to_byte_shape(shape, qtype), np.dtype(np.uint8)


Source = Callable[[str], Iterator[tuple[str, torch.Tensor]]]  # device -> (checkpoint name, tensor)


def write_gguf(path: Path, cfg: ModelConfig, source: Source, qtype: T, tokenizer_dir: Path | None = None, device="cpu"):
    """Write `source`'s tensors to `path` as llama.cpp's converter would (`gguf_tensors`,
    `storage_type`), with cfg's metadata and, given a tokenizer directory, its vocabulary.
    source("meta") gives the shapes (the tensor infos come first in a GGUF), source(device) the values."""
    arch = ARCH_OF[cfg.family]
    names = [name for name, _ in source("meta")]
    num_mtp = int(any(n.startswith("mtp.") for n in names))
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers + num_mtp)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg, num_mtp, qtype)
    if tokenizer_dir is not None:
        from nextn.gguf_tokenizer import write_vocab

        # its eos too (tokenizer_config.json's, as SpecialVocab takes it); the token list padded to the
        # embedding's rows, as the converter's get_vocab_base pads it ([PAD{i}])
        write_vocab(writer, Path(tokenizer_dir), vocab_size=cfg.vocab_size)
    elif cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    plan = []
    for name, t in source("meta"):
        for new, v in gguf_tensors(name, t, cfg, tensor_map):
            shape = tuple(v.squeeze().shape)
            kind = storage_type(new, shape, name, qtype)
            plan.append(kind)
            byte_shape, dtype = _stored_shape(shape, kind)
            writer.add_tensor_info(new, byte_shape, dtype, int(np.prod(byte_shape)) * dtype.itemsize, raw_dtype=kind)
    writer.write_header_to_file(path=Path(path))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    kinds = iter(plan)
    for name, t in tqdm(source(device), total=len(names), desc=f"writing {Path(path).name}", unit="tensor"):
        for _, v in gguf_tensors(name, t, cfg, tensor_map):
            writer.write_tensor_data(stored(v.squeeze(), next(kinds)))
    writer.close()


def _write_metadata(writer, cfg: ModelConfig, num_mtp: int, qtype: T) -> None:
    """TextModel.set_gguf_parameters, Qwen2MoeModel's expert sizes, Qwen3NextModel's ssm_* keys,
    _Qwen35MRopeMixin's rope sections and _Qwen35MtpMixin's block count and nextn_predict_layers."""
    writer.add_block_count(cfg.num_hidden_layers + num_mtp)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if cfg.intermediate_size:
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_file_type(_FILE_TYPES[qtype])
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_dim)
    interval = cfg.layer_types.index("full_attention") + 1
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(cfg.rotary_dim)
    if cfg.family != "qwen3_next":
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if num_mtp:
        writer.add_nextn_predict_layers(num_mtp)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def random_source(cfg: ModelConfig, seed: int = 0, with_mtp: bool = True) -> Source:
    """The tensors of cfg's model with random weights (nextn.models.random_weights's draws), one at
    a time on the device; their names are the checkpoint's (nextn's modules keep them)."""
    from nextn.models.qwen3_5 import CausalLM
    from nextn.models.random_weights import _random_

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(cfg, num_mtp_layers=int(with_mtp)).state_dict().items()}

    def tensors(device: str) -> Iterator[tuple[str, torch.Tensor]]:
        gen = None if device == "meta" else torch.Generator(device=device).manual_seed(seed)
        for name, shape in shapes.items():
            t = torch.empty(shape, device=device, dtype=torch.float32)
            if gen is not None:
                _random_(name, t, gen, cfg)
            yield name, t

    return tensors


def main(argv: list[str] | None = None) -> int:
    from nextn.models.random_weights import PRESETS, preset_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    shape = p.add_mutually_exclusive_group(required=True)
    shape.add_argument("--preset", choices=sorted(PRESETS), help="a random-weight preset's shape")
    shape.add_argument("--config", type=Path, help="a checkpoint's config.json (the shape of that model)")
    p.add_argument("--type", choices=sorted(TYPES), default="bf16", help="weight type of the matrices (default bf16)")
    p.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory whose vocabulary the file carries")
    p.add_argument("--no-mtp", action="store_true", help="leave out the NextN (MTP) block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where weights are drawn")
    args = p.parse_args(argv)
    if not args.out.resolve().parent.is_dir():
        p.error(f"--out {args.out}: its folder does not exist")
    cfg = preset_config(args.preset) if args.preset else ModelConfig.from_dict(json.loads(args.config.read_text()))
    if cfg.family not in ARCH_OF:
        p.error(f"family {cfg.family} has no llama.cpp architecture")
    source = random_source(cfg, args.seed, with_mtp=not args.no_mtp)
    write_gguf(args.out, cfg, source, TYPES[args.type], args.tokenizer, args.device)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
