"""draftline: EAGLE-3 drafter training and engine evaluation for vLLM and SGLang (library; no Prefect here)."""

__version__ = "0.1.0"
