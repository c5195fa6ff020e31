from nextn.cache.hybrid import CacheLayout, HybridCache, SlotCache, StepBatch, commit_ctl
from nextn.cache.pool import CacheMemoryError, SlotPool

__all__ = ["CacheLayout", "CacheMemoryError", "HybridCache", "SlotCache", "SlotPool", "StepBatch", "commit_ctl"]
