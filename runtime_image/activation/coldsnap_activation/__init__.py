"""The ColdSnap activation runtime: the per-unit rank controller.

It is not baked into capsules: the collection stages it per host under
``<state_root>/activation-runtime/sha256/<digest>/`` (content-addressed) and
runs it from there (runtime host) or bind-mounts it read-only (runtime docker),
so activation code can be fixed without recapturing while ``ABI`` matches.
"""

ABI = 1
