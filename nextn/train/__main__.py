"""`python -m nextn.train --data DIR --out RUN_DIR ...`: the `nextn train` flags without the CLI."""

import argparse
import sys

from nextn.train import add_train_args, run_from_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m nextn.train")
    add_train_args(parser)
    try:
        sys.exit(run_from_args(parser.parse_args()))
    except ValueError as e:  # a setting to fix: one line, status 2, as `nextn train` says it
        parser.exit(2, f"{parser.prog}: error: {e}\n")
