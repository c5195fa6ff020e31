"""Every training setting, in frozen dataclasses validated once: the model's shape (what goes
into config.json), the data (nextn.train.data.DataSettings) and the run itself.

No environment variables: what is not here is not a setting.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from nextn.train.data import DataSettings

GDN_KERNELS = ("torch", "fla")


@dataclass(frozen=True)
class ModelShape:
    """A dense Qwen3.5-layout model: Gated DeltaNet layers with a gated attention layer every
    `full_attention_interval`, tied embeddings, one MTP layer."""

    vocab_size: int = 8192  # the BPE's size, special tokens included (the trained BPE may be smaller)
    hidden_size: int = 384
    num_hidden_layers: int = 8
    full_attention_interval: int = 4
    intermediate_size: int = 1024
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.num_hidden_layers % self.full_attention_interval:
            raise ValueError("num_hidden_layers must be a multiple of full_attention_interval")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be >= 512 (256 byte symbols plus merges)")

    def layer_types(self) -> list[str]:
        n = self.full_attention_interval
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)]

    def hf_config(self, vocab_size: int, eos_token_id: int) -> dict:
        """config.json of a transformers Qwen3_5ForCausalLM (text-only) with `vocab_size` rows."""
        half = int(self.head_dim * self.partial_rotary_factor) // 2
        # text positions put one value in all three mrope sections; the split only has to add up
        mrope = [half - 2 * (half // 3), half // 3, half // 3]
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": self.layer_types(),
            "full_attention_interval": self.full_attention_interval,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": 4,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_interleaved": True,
                "mrope_section": mrope,
            },
            "tie_word_embeddings": True,
            "mtp_num_hidden_layers": 1,
            "use_cache": True,
            "bos_token_id": None,
            "eos_token_id": eos_token_id,
            "pad_token_id": None,
        }


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str
    data: DataSettings
    shape: ModelShape = field(default_factory=ModelShape)
    # head distillation: train only mtp.* of this checkpoint, from its trunk's hidden states
    distill_from: str | None = None
    # fine-tuning: every weight of this checkpoint (trunk and MTP head) trains on the data, with its tokenizer
    finetune_from: str | None = None
    # head distillation: also train draft steps 2..chain_depth of the head's own chain (its
    # output hidden fed back, as the proposer drafts), depth d's loss weighted chain_decay ** (d - 1)
    chain_depth: int = 1
    chain_decay: float = 0.7
    # head distillation: the target is (1 - w) * the trunk's distribution + w * one-hot of its
    # argmax (objective.distill_losses): w > 0 makes the head's confidence track greedy acceptance
    argmax_weight: float = 0.0
    # duration: stop at whichever comes first. minutes: time in the training loop, summed over
    # resumes; wall_minutes: this invocation's wall clock, data preparation included. The LR
    # schedule is stretched over whichever limit binds.
    minutes: float | None = None
    max_steps: int | None = None
    wall_minutes: float | None = None
    seq_len: int = 1024
    batch_size: int = 64  # sequences per step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    head_loss_weight: float = 0.3  # total = trunk CE + weight * head CE
    tokenizer_sample_mb: float = 20.0
    log_every: int = 20
    eval_every: int = 250
    eval_sequences: int = 64
    save_every: int = 1000
    device: str = "cpu"
    dtype: str = "float32"  # autocast dtype of the forward (weights stay float32)
    save_dtype: str = "bfloat16"  # the checkpoint's tensors
    max_shard_mb: float = 14.0
    gdn_kernel: str = "torch"  # "torch" (nextn.ops.gdn) | "fla" (flash-linear-attention, CUDA)
    compile: bool = False  # torch.compile each decoder layer
    seed: int = 0

    def __post_init__(self):
        if self.minutes is None and self.max_steps is None and self.wall_minutes is None:
            raise ValueError("give a duration: minutes, max_steps or wall_minutes")
        for name in ("minutes", "max_steps", "wall_minutes"):
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.gdn_kernel not in GDN_KERNELS:
            raise ValueError(f"gdn_kernel must be one of {GDN_KERNELS}, got {self.gdn_kernel!r}")
        if self.gdn_kernel == "fla" and not self.device.startswith("cuda"):
            raise ValueError("the fla GDN kernel runs on CUDA only")
        for name in ("dtype", "save_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name} must be float32, bfloat16 or float16")
        if self.seq_len < 4 or self.batch_size < 1:
            raise ValueError("seq_len must be >= 4 and batch_size >= 1")
        if self.chain_depth < 1 or (self.chain_depth > 1 and self.distill_from is None):
            raise ValueError("chain_depth must be >= 1, and above 1 only with head distillation (distill_from)")
        if not 0.0 <= self.argmax_weight <= 1.0 or (self.argmax_weight > 0 and self.distill_from is None):
            raise ValueError("argmax_weight must be in [0, 1], and above 0 only with head distillation (distill_from)")
        if self.chain_depth >= self.seq_len:
            raise ValueError("chain_depth must be below seq_len")
        if self.distill_from is not None and self.finetune_from is not None:
            raise ValueError("distill_from and finetune_from exclude each other")
        if self.distill_from is None and not self.data.roots:
            raise ValueError("give at least one data folder")

    @property
    def source(self) -> str | None:
        """The checkpoint a run starts from (distillation or fine-tuning), None for a fresh model."""
        return self.distill_from or self.finetune_from

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: dict) -> TrainConfig:
        raw = dict(raw)
        data = dict(raw.pop("data"))
        data["roots"], data["suffixes"] = tuple(data["roots"]), tuple(data["suffixes"])
        return cls(data=DataSettings(**data), shape=ModelShape(**raw.pop("shape")), **raw)


# settings a resumed run may change; everything else must match the run's saved config
RESUMABLE_CHANGES = frozenset(
    {"minutes", "max_steps", "wall_minutes", "log_every", "eval_every", "save_every", "device", "compile", "gdn_kernel"}
)
# settings the tokenizer and the token arrays of a run depend on
DATA_FIELDS = ("data", "tokenizer_sample_mb", "distill_from", "finetune_from")


def check_resume(saved: TrainConfig, new: TrainConfig) -> None:
    """A resumed run must train the same model on the same data."""
    old, cur = dataclasses.asdict(saved), dataclasses.asdict(new)
    changed = sorted(k for k in cur if k not in RESUMABLE_CHANGES and k != "run_dir" and old.get(k) != cur[k])
    if changed:
        raise ValueError(
            f"{new.run_dir} holds a run with other settings ({', '.join(changed)}); "
            "resume with the same settings or use a new run directory"
        )
