"""What a training run tells its user: progress lines on stderr, the loss CSV (appended as the run
goes, so a resumed run continues it) and a PNG of the loss curves drawn from that CSV."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

COLUMNS = (
    "step",
    "tokens",
    "elapsed_s",
    "split",
    "trunk_loss",
    "head_loss",
    "head_acc",
    "head_agree",
    "accept_len",
    "lr",
)


def log(msg: str) -> None:
    print(f"nextn train: {msg}", file=sys.stderr, flush=True)


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_line(step: int, max_steps: int | None, tok_per_s: float, row: dict, eta_s: float | None) -> str:
    total = f"/{max_steps}" if max_steps else ""
    eta = fmt_duration(eta_s) if eta_s is not None else "?"
    return (
        f"step {step}{total} | {tok_per_s / 1e3:,.1f}k tok/s | trunk {row['trunk_loss']:.4f} | "
        f"head {row['head_loss']:.4f} | head acc {row['head_acc']:.3f} | agree {row['head_agree']:.3f} | "
        f"acc len {row['accept_len']:.3f} | lr {row['lr']:.2e} | ETA {eta}"
    )


class LossCSV:
    def __init__(self, path: Path, after_step: int):
        """Open for appending; on resume, rows past `after_step` (written after the last saved
        state) are dropped so the file matches the state being resumed."""
        self.path = path
        rows = read_rows(path) if path.is_file() else []
        keep = [r for r in rows if int(r["step"]) <= after_step]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(keep)

    def append(self, row: dict) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerow({k: row[k] for k in COLUMNS})


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def plot_losses(csv_path: Path, png_path: Path, title: str) -> bool:
    """Trunk and head loss against tokens seen, train and held-out. Returns False (and says so on
    stderr) when matplotlib is not installed: the CSV holds the same numbers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(
            f"matplotlib is not installed (pip install 'nextn[train]'): no {png_path.name}; "
            f"{csv_path.name} has the numbers"
        )
        return False
    rows = read_rows(csv_path)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for split, style in (("train", "-"), ("heldout", "o--")):
        sel = [r for r in rows if r["split"] == split]
        tokens = [int(r["tokens"]) / 1e6 for r in sel]
        for key, color in (("trunk_loss", "tab:blue"), ("head_loss", "tab:orange")):
            label = f"{key.split('_')[0]} ({split})"
            ax.plot(tokens, [float(r[key]) for r in sel], style, color=color, label=label, markersize=3)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return True
