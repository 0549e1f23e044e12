"""Model payloads: pack + residual + manifest layout, verifier, validation records, node cache, hydration.

layout (extents, maps, pack order) -> pack (capture writer) -> cache (content-addressed store)
-> verifier (admission) -> stage (put a worker's payload on its host) -> provider (which source)
-> hydrate / cuda (rebuild allocations). See docs/payloads.md.
"""
