"""Prefect flows: composition only; each reads like its step of the DAG (generate-traces → ... → evaluate)."""
import os

# Show the library's own progress (training loss, shard counts) in Prefect's logs and UI.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftline")
