"""Sampling the next tokens from the logits: the Sampler, its per-step metadata, and the
greedy decode steps in one C call."""
