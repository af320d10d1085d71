"""Online training: a capturing vLLM server feeds the trainer directly through a local hand-off folder, so no
training hidden states are written to the store (plan, spool, engine side, trainer side, and both in one call)."""
