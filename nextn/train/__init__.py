"""`nextn train`: a byte-level BPE, data packing, joint trunk + MTP head training and MTP head
distillation, writing Hugging Face checkpoints. The CLI wires `add_train_args` / `run_from_args`;
`python -m nextn.train ...` runs the same flags without the CLI."""

from nextn.train.args import add_train_args, config_from_args, run_from_args

__all__ = ["add_train_args", "config_from_args", "run_from_args"]
