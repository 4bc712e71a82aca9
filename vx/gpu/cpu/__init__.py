"""Everything CPU-only in the Worker: the C kernel library (its sources in `csrc/`, its build
and load in `library`, its ABI table in `abi`), the weight layouts its kernels read (VNNI,
widened, compact, huge pages), the row plans, the LM head's int8 screen, the ops on the module
path, and the fused decode step."""
