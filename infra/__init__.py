"""Deployment and local-topology code that runs beside the draftline package, never inside it."""
