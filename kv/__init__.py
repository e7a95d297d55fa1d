"""KV memory: block accounting (pure Python) and, in cache_engine, the tensors and copies."""

from fairbatch.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block
from fairbatch.kv.manager import KVCacheManager

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "KVCacheManager", "hash_block"]
