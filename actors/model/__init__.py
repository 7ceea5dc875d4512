"""A model on its device: the architecture checks, the backends over the slot KV cache, batched
rows, attention masks, the KV budget and the simulated device."""
