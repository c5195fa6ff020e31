"""What nextn's processes show their user, shared by the command line and the engine core process
of `nextn serve`: the one logging setup, and which errors are the user's to fix (printed as one
line, without a traceback)."""

from __future__ import annotations

import logging


def setup_logging(level: str) -> None:
    """The one logging setup: nextn's loggers at `level`, everything else at warning, on stderr."""
    logging.basicConfig(format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("nextn").setLevel(level.upper())


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user can fix (a flag, a path, a file, the install, a memory budget): one line, no traceback."""
    import torch

    return (ValueError, OSError, ImportError, torch.OutOfMemoryError)
