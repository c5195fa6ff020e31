"""Tensor parallelism: a model sharded over N ranks, one process per rank, on torch.distributed
(NCCL on CUDA, gloo on the CPU). `shard`: which part of each tensor a rank holds; `comm`: the
collectives of the forward (one all-reduce per block, in a fixed order); `launch`: the processes.
How the engine stays the same on every rank is nextn.engine.replica's.
"""
