"""IF nodes in a CUDA graph capture (nextn.engine.graph_if): a body runs at replay only where its
predicate holds when its setter runs, bodies nest, a body's allocations stay valid, and the work
after the node waits for it. GPU only (CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")


def test_if_nodes_run_their_bodies_where_the_predicate_holds():
    from nextn.engine.graph_if import GraphIf

    dev = torch.device("cuda")
    gif = GraphIf(dev)
    pred = torch.zeros((), dtype=torch.bool, device=dev)
    inner = torch.zeros((), dtype=torch.bool, device=dev)
    x = torch.zeros(4, device=dev)

    def body():
        x[0] += 1
        tmp = x[1:2] * 0 + 10  # allocated inside the body
        x[1:2].add_(tmp)

        def nested():
            x[2] += 1

        gif.capture_if(inner, nested)
        inner.fill_(True)  # a body may set the next node's predicate

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gif.capture_if(pred, body)
        x[3] = x[0] + x[2]  # after the node: sees what the body wrote
    expected = torch.zeros(4)
    for p, i in [(False, False), (True, False), (True, True), (False, True), (True, False)]:
        pred.fill_(p)
        inner.fill_(i)
        graph.replay()
        if p:
            expected[0] += 1
            expected[1] += 10
            expected[2] += i
        expected[3] = expected[0] + expected[2]
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), expected), (p, i, x.cpu(), expected)


def test_an_if_node_needs_a_capture_and_a_bool_scalar():
    from nextn.engine.graph_if import GraphIf

    gif = GraphIf(torch.device("cuda"))
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        gif.capture_if(torch.ones((), dtype=torch.bool, device="cuda"), lambda: None)
    with pytest.raises(ValueError, match="bool device scalar"):
        gif.capture_if(torch.ones((), dtype=torch.int32, device="cuda"), lambda: None)
