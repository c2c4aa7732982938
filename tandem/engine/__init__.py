"""Model execution: loading a model, its KV pool and attention, batched forward passes on one inference thread."""
