"""Launch configs as the compiler and the GPU see them.

Owns: ``compiler.py`` (what Triton makes of the kernels for a GPU architecture without that GPU:
it emulates the target, drives the real launchers as compile-only warmups and reads registers,
spills, shared memory, MMA kind and count from the compiled kernels; static compiler output, not
speed). The compile report (``python -m bench --what kernels``) and tests/kernels/test_kernel_structure.py
use it.

May import: anything in coreattn (a tool above the public API, like ``coreattn.selfcheck``);
nothing in coreattn's kernels, layers or adapters imports it.
"""
