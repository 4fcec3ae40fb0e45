"""KV memory's data structures in the scheduler process: the paged K/V pool, the page allocator,
the request->slot table and the radix prefix cache. The scheduler's KVCache
(engine/scheduler/kv_cache.py) is their only user that allocates or frees."""
