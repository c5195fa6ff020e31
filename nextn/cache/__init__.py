from nextn.cache.hybrid import KV, CacheLayout, HybridCache, SlotCache, StepBatch, commit_ctl
from nextn.cache.pool import CacheMemoryError, SlotPool

__all__ = ["KV", "CacheLayout", "CacheMemoryError", "HybridCache", "SlotCache", "SlotPool", "StepBatch", "commit_ctl"]
