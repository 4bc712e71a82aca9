"""Paged attention over the block-table KV cache: the CPU and torch path, the per-step
metadata it reads, and the Triton kernels of the CUDA path."""
