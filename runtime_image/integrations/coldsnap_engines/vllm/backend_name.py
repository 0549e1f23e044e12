"""Where vLLM's sleep-mode backend factory finds ColdSnap's backend (no vLLM import here)."""

BACKEND_NAME = "coldsnap"
BACKEND_MODULE = "coldsnap_engines.vllm.backend"
BACKEND_CLASS = "ColdSnapSleepBackend"
