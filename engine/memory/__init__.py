"""KV memory of the scheduler process: the paged pool, the page allocator, the request->slot
table and the radix prefix cache. The scheduler loop is its only owner."""
