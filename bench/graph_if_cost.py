"""What an IF node costs inside a CUDA graph (nextn.engine.graph_if): replay time of a graph of
N small kernels, as plain kernels, inside IF nodes taken / skipped, nested or in sequence.
Usage: python bench/graph_if_cost.py  (CUDA)"""

import torch

from nextn.engine.graph_if import GraphIf


def main() -> None:
    dev = torch.device("cuda", 0)
    gif = GraphIf(dev)
    x = torch.zeros(1024, device=dev)
    pred = torch.ones((), dtype=torch.bool, device=dev)
    steps, kernels = 6, 10

    def work():
        for _ in range(kernels):
            x.add_(1)

    def plain():
        for _ in range(steps):
            work()

    def sequential():
        for _ in range(steps):
            gif.capture_if(pred, work)

    def nested(j=0):
        work()
        if j + 1 < steps:
            gif.capture_if(pred, lambda: nested(j + 1))

    for name, fn in (
        ("plain", plain),
        ("sequential IF", sequential),
        ("nested IF", lambda: gif.capture_if(pred, nested)),
    ):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for taken in (True, False):
            pred.fill_(taken)
            for _ in range(20):
                g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            print(
                f"{name:14s} pred={taken!s:5s}: {start.elapsed_time(end) / 200 * 1e3:7.1f} us per replay "
                f"({steps} steps x {kernels} kernels)"
            )


if __name__ == "__main__":
    main()
