"""`train(cfg)`: train a Qwen3.5-layout model with its MTP head (or, with `distill_from`, only the
head of an existing checkpoint) and write Hugging Face checkpoints into the run directory.

Run directory: train_config.json, tokenizer/, data/ (token arrays), checkpoint/ (the latest HF
checkpoint), state.pt (resumable state), loss.csv, loss.png. Pointing `train` at a directory that
holds state.pt resumes that run.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from nextn.models.qwen3_5 import CausalLM
from nextn.ops import OPS
from nextn.train import data as data_mod
from nextn.train import objective, report
from nextn.train.checkpoint import load_state, save_state, write_checkpoint
from nextn.train.config import DATA_FIELDS, TrainConfig, check_resume
from nextn.train.model_setup import build_model, checkpoint_model
from nextn.train.tokenizer import (
    ENDOFTEXT,
    TOKENIZER_FILES,
    build_tokenizer,
    load_tokenizer,
    token_id,
    write_tokenizer_files,
)

CONFIG_FILE = "train_config.json"
METRICS = ("trunk_loss", "head_loss", "head_acc", "head_agree", "accept_len")  # logged per step and held out


def _metrics(losses: objective.Losses) -> torch.Tensor:
    return (
        torch.stack([losses.trunk, losses.head, losses.head_acc, losses.head_agree, losses.accept_len]).detach().float()
    )


def prepare_tokenizer(cfg: TrainConfig) -> Path:
    """run_dir/tokenizer: copied from the checkpoint the run starts from, or trained on a train-split sample."""
    out = cfg.run_path / "tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    if cfg.source:
        out.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            shutil.copy(Path(cfg.source) / name, out / name)
        return out
    t0 = time.perf_counter()
    files = data_mod.find_files(list(cfg.data.roots), cfg.data.suffixes, cfg.data.max_file_bytes)
    train_files, _ = data_mod.split_files(files, cfg.data.heldout_percent, cfg.data.seed)
    texts = data_mod.sample_texts(train_files, int(cfg.tokenizer_sample_mb * 1e6))
    tok = build_tokenizer(texts, cfg.shape.vocab_size)
    write_tokenizer_files(tok, out)
    report.log(
        f"tokenizer: {tok.get_vocab_size()} tokens from {sum(map(len, texts)) / 1e6:.1f} MB "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return out


def prepare_data(cfg: TrainConfig, tok) -> tuple[np.ndarray, np.ndarray]:
    """Packed train and held-out rows [N, seq_len + 1]; tokenised once into run_dir/data."""
    data_dir = cfg.run_path / "data"
    if not (data_dir / "meta.json").is_file():
        t0 = time.perf_counter()
        meta = data_mod.prepare(tok, cfg.data, token_id(tok, ENDOFTEXT), data_dir)
        report.log(
            f"data: {meta['train_files']} train / {meta['heldout_files']} held-out files, "
            f"{meta['train_tokens'] / 1e6:.1f}M / {meta['heldout_tokens'] / 1e6:.2f}M tokens "
            f"in {time.perf_counter() - t0:.1f}s"
        )
    train_rows = data_mod.pack(data_mod.load_stream(data_dir, "train"), cfg.seq_len)
    heldout = data_mod.load_stream(data_dir, "heldout")
    if cfg.data.heldout_percent > 0 and len(heldout) <= cfg.seq_len:
        raise ValueError(
            f"the held-out split has {len(heldout)} tokens, too few for one sequence of "
            f"{cfg.seq_len + 1}: raise heldout_percent, add files, or set it to 0 (no evaluation)"
        )
    heldout_rows = (
        data_mod.pack(heldout, cfg.seq_len) if cfg.data.heldout_percent > 0 else heldout[:0].reshape(0, cfg.seq_len + 1)
    )
    return train_rows, heldout_rows


def lr_at(cfg: TrainConfig, step: int, elapsed: float, planned_s: float | None) -> float:
    """Linear warmup over steps, then cosine to min_lr_ratio over the run's progress: the larger
    of steps done / max_steps and loop time spent / planned loop time (whichever limit binds)."""
    progress = 0.0
    if cfg.max_steps:
        progress = step / cfg.max_steps
    if planned_s is not None:
        progress = max(progress, elapsed / planned_s if planned_s > 0 else 1.0)
    decay = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay)


def finish_reserve(wall_s: float) -> float:
    """Wall time kept for the final evaluation and checkpoint."""
    return min(30.0, 0.1 * wall_s)


def plan_seconds(cfg: TrainConfig, elapsed: float, deadline: float | None) -> float | None:
    """Total loop time the run may reach: minutes, and what the wall-clock deadline leaves."""
    limits = [cfg.minutes * 60] if cfg.minutes is not None else []
    if deadline is not None:
        reserve = finish_reserve(cfg.wall_minutes * 60)
        limits.append(elapsed + max(0.0, deadline - time.monotonic() - reserve))
    return min(limits) if limits else None


def make_optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, biases, gates, conv kernels)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim == 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim != 2], "weight_decay": 0.0},
    ]
    fused = cfg.device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


class Run:
    """The state of one training run on its device: model, optimizer, data order, counters."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        tok = load_tokenizer(prepare_tokenizer(cfg))
        train_rows, heldout_rows = prepare_data(cfg, tok)
        self.train_rows = torch.from_numpy(train_rows.astype(np.int32)).to(self.device)
        self.heldout_rows = torch.from_numpy(heldout_rows.astype(np.int32)).to(self.device)
        if cfg.source:
            self.model, self.hf_config = checkpoint_model(cfg, self.device)
        else:
            self.model, self.hf_config = build_model(cfg, tok, self.device)
        ops = OPS[cfg.gdn_kernel]()  # the chunked delta rule's kernel: torch (any device) or fla (CUDA)
        self.optimizer = make_optimizer(self.model, cfg)
        self.step, self.tokens, self.elapsed = 0, 0, 0.0
        self.planned_s: float | None = None  # loop time this run may reach (set when the loop starts)
        self.last_eval_step = -1
        self.order = data_mod.SequenceOrder(len(train_rows), cfg.data.seed)
        self._restore(load_state(cfg.run_path))
        if cfg.compile:
            for layer in list(self.model.model.layers) + list(self.model.mtp.layers):
                layer.compile()
        self.loss_fn = (
            (lambda m, x: objective.distill_losses(m, x, cfg.chain_depth, cfg.chain_decay, ops, cfg.argmax_weight))
            if (cfg.distill_from)
            else (lambda m, x: objective.joint_losses(m, x, cfg.head_loss_weight, ops))
        )

    def _restore(self, state: dict | None) -> None:
        if state is None:
            return
        # the state holds the trained tensors only (a distillation's frozen trunk comes from its checkpoint)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if unexpected or trained & set(missing):
            raise ValueError(
                f"{self.cfg.run_dir}/state.pt does not match the model: "
                f"missing {sorted(trained & set(missing))[:4]}, unexpected {unexpected[:4]}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.tokens, self.elapsed = state["step"], state["tokens"], state["elapsed"]
        self.order.position = state["position"]
        report.log(f"resuming {self.cfg.run_dir} at step {self.step} ({self.tokens / 1e6:.1f}M tokens)")

    def autocast(self):
        if self.cfg.dtype == "float32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.cfg.dtype))

    def save(self) -> Path:
        out = self.cfg.run_path / "checkpoint"
        write_checkpoint(
            self.model,
            self.hf_config,
            self.cfg.run_path / "tokenizer",
            out,
            self.cfg.save_dtype,
            int(self.cfg.max_shard_mb * 2**20),
        )
        save_state(
            self.cfg.run_path,
            {
                "model": {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad},
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "tokens": self.tokens,
                "elapsed": self.elapsed,
                "position": self.order.position,
            },
        )
        return out

    def train_step(self, lr: float) -> objective.Losses:
        idx = torch.from_numpy(self.order.next_rows(self.cfg.batch_size)).to(self.device)
        x = self.train_rows[idx].long()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.autocast():
            losses = self.loss_fn(self.model, x)
        losses.objective.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += x.shape[0] * (x.shape[1] - 1)
        return losses

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean losses over the first eval_sequences held-out rows."""
        rows = self.heldout_rows[: self.cfg.eval_sequences]
        sums, n = torch.zeros(len(METRICS), device=self.device), 0
        for i in range(0, len(rows), self.cfg.batch_size):
            x = rows[i : i + self.cfg.batch_size].long()
            with self.autocast():
                losses = self.loss_fn(self.model, x)
            sums += _metrics(losses) * len(x)
            n += len(x)
        means = (sums / n).tolist()
        return dict(zip(METRICS, means, strict=True))


def train(cfg: TrainConfig) -> Path:
    """Train (or resume) the run in cfg.run_dir; returns the checkpoint directory."""
    deadline = time.monotonic() + cfg.wall_minutes * 60 if cfg.wall_minutes else None
    cfg.run_path.mkdir(parents=True, exist_ok=True)
    config_path = cfg.run_path / CONFIG_FILE
    if config_path.is_file():
        saved = TrainConfig.from_dict(json.loads(config_path.read_text()))
        if (cfg.run_path / "state.pt").is_file():
            check_resume(saved, cfg)
        elif (
            any(getattr(saved, f) != getattr(cfg, f) for f in DATA_FIELDS)
            or saved.shape.vocab_size != cfg.shape.vocab_size
        ):
            for derived in ("tokenizer", "data"):  # an unstarted run's tokens are stale
                shutil.rmtree(cfg.run_path / derived, ignore_errors=True)
    config_path.write_text(cfg.to_json())
    torch.manual_seed(cfg.seed)
    if cfg.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    run = Run(cfg)
    n_params = sum(p.numel() for p in run.model.parameters())
    n_train = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    report.log(
        f"model: {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trained), "
        f"{len(run.train_rows)} train rows of {cfg.seq_len + 1} tokens, gdn kernel {cfg.gdn_kernel}"
    )
    csv = report.LossCSV(cfg.run_path / "loss.csv", run.step)
    run.planned_s = plan_seconds(cfg, run.elapsed, deadline)
    if run.planned_s is not None:
        report.log(f"training for up to {report.fmt_duration(run.planned_s - run.elapsed)} more")
    loop(run, csv)
    return finish(run, csv)


def _done(run: Run) -> bool:
    cfg = run.cfg
    return (cfg.max_steps is not None and run.step >= cfg.max_steps) or (
        run.planned_s is not None and run.elapsed >= run.planned_s
    )


def _eta(run: Run, sec_per_step: float) -> float | None:
    etas = []
    if run.cfg.max_steps is not None:
        etas.append((run.cfg.max_steps - run.step) * sec_per_step)
    if run.planned_s is not None:
        etas.append(run.planned_s - run.elapsed)
    return min(etas) if etas else None


def loop(run: Run, csv: report.LossCSV) -> None:
    """Steps until a limit; a progress line every log_every steps (the one host sync there)."""
    cfg = run.cfg
    run.model.train()
    acc, n_acc = None, 0
    t_mark, tokens_mark, steps_mark = time.perf_counter(), run.tokens, run.step
    while not _done(run):
        t0 = time.perf_counter()
        lr = lr_at(cfg, run.step, run.elapsed, run.planned_s)
        losses = run.train_step(lr)
        vals = _metrics(losses)
        acc, n_acc = (vals if acc is None else acc + vals), n_acc + 1
        now = time.perf_counter()
        run.elapsed += now - t0  # loop time: the step here, evaluation and saving below
        t0 = now
        last = _done(run)
        if run.step % cfg.log_every == 0 or last:
            means = (acc / n_acc).tolist()
            acc, n_acc = None, 0
            if not all(math.isfinite(v) for v in means):
                raise FloatingPointError(f"non-finite loss at step {run.step}: {means}")
            now = time.perf_counter()
            row = dict(zip(METRICS, means, strict=True), lr=lr)
            csv.append(
                {**row, "step": run.step, "tokens": run.tokens, "elapsed_s": round(run.elapsed, 1), "split": "train"}
            )
            tok_s = (run.tokens - tokens_mark) / (now - t_mark)
            eta = _eta(run, (now - t_mark) / (run.step - steps_mark))
            report.log(report.progress_line(run.step, cfg.max_steps, tok_s, row, eta))
            t_mark, tokens_mark, steps_mark = now, run.tokens, run.step
        if not last and run.step % cfg.eval_every == 0:
            eval_and_log(run, csv, lr)
        if not last and run.step % cfg.save_every == 0:
            run.save()
        if not last and (run.step % cfg.eval_every == 0 or run.step % cfg.save_every == 0):
            t_mark, tokens_mark, steps_mark = time.perf_counter(), run.tokens, run.step  # tok/s: steps only
        run.elapsed += time.perf_counter() - t0


def eval_and_log(run: Run, csv: report.LossCSV, lr: float) -> dict | None:
    if len(run.heldout_rows) == 0 or run.last_eval_step == run.step:
        return None
    run.last_eval_step = run.step
    run.model.eval()
    row = run.evaluate()
    run.model.train()
    csv.append(
        {
            **row,
            "lr": lr,
            "step": run.step,
            "tokens": run.tokens,
            "elapsed_s": round(run.elapsed, 1),
            "split": "heldout",
        }
    )
    report.log(
        f"held-out at step {run.step}: trunk {row['trunk_loss']:.4f} | head {row['head_loss']:.4f} | "
        f"head acc {row['head_acc']:.3f} | head agrees with trunk {row['head_agree']:.3f} | "
        f"teacher-forced acceptance length {row['accept_len']:.3f}"
    )
    return row


def finish(run: Run, csv: report.LossCSV) -> Path:
    eval_and_log(run, csv, lr_at(run.cfg, run.step, run.elapsed, run.planned_s))
    out = run.save()
    report.plot_losses(csv.path, run.cfg.run_path / "loss.png", f"nextn train: {run.cfg.run_path.name}")
    report.log(
        f"done: step {run.step}, {run.tokens / 1e6:.1f}M tokens, {report.fmt_duration(run.elapsed)} "
        f"training; checkpoint in {out}"
    )
    return out
