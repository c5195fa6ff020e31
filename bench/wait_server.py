"""Wait for a server started in the background to answer /health (the serving benches' one wait).

    python3 bench/wait_server.py PORT PID [SECONDS]     (default 120)

Exits 0 once http://127.0.0.1:PORT/health answers 200; 1 with a line saying why if the process PID
exits first or SECONDS pass."""

from __future__ import annotations

import os
import sys
import time
import urllib.request


def main() -> int:
    port, pid = sys.argv[1], int(sys.argv[2])
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 120.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"wait_server: the server (pid {pid}) exited before it was ready", file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return 0
        except OSError:
            pass
        time.sleep(0.5)
    print(f"wait_server: the server on port {port} was not ready in {seconds:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
