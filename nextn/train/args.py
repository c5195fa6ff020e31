"""`nextn train` flags: `add_train_args(parser)` declares them, `config_from_args(ns)` turns the
parsed namespace into a TrainConfig, `run_from_args(ns)` trains. nextn/cli.py wires these in."""

from __future__ import annotations

import argparse

from nextn.train.config import GDN_KERNELS, ModelShape, TrainConfig
from nextn.train.data import DataSettings

_SHAPE, _DATA = ModelShape(), DataSettings(roots=())


def _add(parser: argparse.ArgumentParser, *flags, **kwargs) -> None:
    """Add a flag unless the parser already has it (the common --model/--device/--dtype)."""
    if not any(f in parser._option_string_actions for f in flags):
        parser.add_argument(*flags, **kwargs)


def add_train_args(parser: argparse.ArgumentParser) -> None:
    _add(
        parser,
        "--model",
        default=None,
        help="with --distill-from omitted: a checkpoint whose MTP head to train (head distillation)",
    )
    _add(parser, "--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    _add(
        parser,
        "--dtype",
        default=None,
        help="autocast dtype of the forward: float32, bfloat16, float16 (default bfloat16 on CUDA, float32 on CPU)",
    )
    g = parser.add_argument_group("run")
    g.add_argument("--data", action="append", default=[], metavar="DIR", help="folder of text files (repeatable)")
    g.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory; an existing run there is resumed")
    g.add_argument("--distill-from", metavar="CKPT", help="train only the MTP head of this checkpoint")
    g.add_argument(
        "--finetune-from", metavar="CKPT", help="train every weight of this checkpoint (trunk and head) on --data"
    )
    g.add_argument(
        "--chain-depth",
        type=int,
        default=1,
        help="with distillation: also train draft steps 2..D of the head's own chain (default 1)",
    )
    g.add_argument("--chain-decay", type=float, default=0.7, help="loss weight of chain depth d: decay ** (d - 1)")
    g.add_argument(
        "--argmax-weight",
        type=float,
        default=0.0,
        help="with distillation: target = (1 - w) * trunk distribution + w * one-hot of its argmax (default 0)",
    )
    g.add_argument("--minutes", type=float, help="stop after this many minutes of training steps")
    g.add_argument("--max-steps", type=int, help="stop after this many steps")
    g.add_argument(
        "--wall-minutes",
        type=float,
        help="stop this invocation after this many wall-clock minutes, data preparation included",
    )
    g.add_argument("--seq-len", type=int, default=1024)
    g.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--warmup-steps", type=int, default=200)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--head-loss-weight", type=float, default=0.3, help="total = trunk CE + w * head CE")
    g.add_argument("--log-every", type=int, default=20)
    g.add_argument("--eval-every", type=int, default=250)
    g.add_argument("--eval-sequences", type=int, default=64)
    g.add_argument("--save-every", type=int, default=1000)
    g.add_argument("--save-dtype", default="bfloat16", help="dtype of the checkpoint's tensors")
    g.add_argument("--max-shard-mb", type=float, default=14.0, help="largest safetensors shard (MiB)")
    g.add_argument(
        "--gdn-kernel",
        choices=GDN_KERNELS,
        default="torch",
        help="chunked delta rule: torch (reference) or fla (flash-linear-attention, CUDA)",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    g.add_argument("--seed", type=int, default=0)
    d = parser.add_argument_group("data")
    d.add_argument("--suffix", action="append", default=None, help="file name ending to read (default .py; repeatable)")
    d.add_argument("--heldout-percent", type=float, default=_DATA.heldout_percent)
    d.add_argument("--max-train-tokens", type=int, default=_DATA.max_train_tokens)
    d.add_argument("--max-heldout-tokens", type=int, default=_DATA.max_heldout_tokens)
    d.add_argument(
        "--max-prep-seconds",
        type=float,
        default=None,
        help="stop tokenising the train split after this long (the run repeats what it has)",
    )
    d.add_argument(
        "--workers",
        type=int,
        default=_DATA.workers,
        help="tokenising processes; 0 (default): the tokenizer's own threads",
    )
    d.add_argument("--tokenizer-sample-mb", type=float, default=20.0, help="text the BPE is trained on")
    m = parser.add_argument_group("model shape (a new run only)")
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    ):
        m.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(_SHAPE, name))


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    distill = ns.distill_from or (None if ns.finetune_from else ns.model)
    if ns.distill_from and ns.model and ns.distill_from != ns.model:
        raise ValueError("--model and --distill-from name different checkpoints")
    dtype = ns.dtype or ("bfloat16" if ns.device.startswith("cuda") else "float32")
    if ns.minutes is None and ns.max_steps is None and ns.wall_minutes is None:
        raise ValueError("give --minutes, --max-steps or --wall-minutes")
    shape = ModelShape(**{f: getattr(ns, f) for f in ModelShape.__dataclass_fields__ if hasattr(ns, f)})
    data = DataSettings(
        roots=tuple(ns.data),
        suffixes=tuple(ns.suffix or (".py",)),
        heldout_percent=ns.heldout_percent,
        max_train_tokens=ns.max_train_tokens,
        max_heldout_tokens=ns.max_heldout_tokens,
        max_prep_seconds=ns.max_prep_seconds,
        workers=ns.workers,
        seed=ns.seed,
    )
    return TrainConfig(
        run_dir=ns.out,
        data=data,
        shape=shape,
        distill_from=distill,
        finetune_from=ns.finetune_from,
        chain_depth=ns.chain_depth,
        chain_decay=ns.chain_decay,
        argmax_weight=ns.argmax_weight,
        minutes=ns.minutes,
        max_steps=ns.max_steps,
        wall_minutes=ns.wall_minutes,
        seq_len=ns.seq_len,
        batch_size=ns.batch_size,
        lr=ns.lr,
        warmup_steps=ns.warmup_steps,
        weight_decay=ns.weight_decay,
        head_loss_weight=ns.head_loss_weight,
        tokenizer_sample_mb=ns.tokenizer_sample_mb,
        log_every=ns.log_every,
        eval_every=ns.eval_every,
        eval_sequences=ns.eval_sequences,
        save_every=ns.save_every,
        device=ns.device,
        dtype=dtype,
        save_dtype=ns.save_dtype,
        max_shard_mb=ns.max_shard_mb,
        gdn_kernel=ns.gdn_kernel,
        compile=ns.compile,
        seed=ns.seed,
    )


def run_from_args(ns: argparse.Namespace) -> int:
    from nextn.train.trainer import train

    train(config_from_args(ns))
    return 0
