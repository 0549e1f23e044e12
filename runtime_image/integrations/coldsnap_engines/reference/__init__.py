"""ColdSnap's reference inference engine: a small Llama-style decoder behind an
OpenAI-compatible server, held to the same integration contract as vLLM
(stable weight allocations, an observing loader, KV discard, sleep/wake)."""
