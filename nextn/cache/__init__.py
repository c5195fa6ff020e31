from nextn.cache.hybrid import CacheSnapshot, HybridCache, LayerKV, StepStash

__all__ = ["CacheSnapshot", "HybridCache", "LayerKV", "StepStash"]
