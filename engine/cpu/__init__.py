"""The CPU's C kernels (engine/csrc/), built for the instruction set of the CPU they run on, in four jobs:

- `build`: compiling a library per instruction set and choosing the one this process uses (`variant()`);
- `abi`: the C interface as ctypes sees it (engine/csrc/kernels.h's codes, structs and signatures);
- `ops`: the kernels as Python functions on tensors, their inputs checked;
- `tuning`: what is measured at start-up (bfloat16 products, the row counts the Linear kernel wins at);
- `routing`: the model rewritten to call them (Linear layers, patch embeddings, RMSNorms).
"""
