"""Online training: a capturing vLLM server feeds the trainer directly through a local hand-off folder (or, across two
machines, through the store, each file deleted once trained), so no training hidden states are kept in the store
(config, plan, spool, relay, engine side, trainer side, and both in one call)."""
