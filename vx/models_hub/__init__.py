"""Finding a model before any Worker starts: the device and its defaults, resolving a model
name or path to local files, and converting GGUF checkpoints.

Runs in: the launcher."""
