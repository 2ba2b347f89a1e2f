"""Launch configs as the compiler and the GPU see them: the compile inspection and the tuner.

Owns: ``compiler.py`` (what Triton makes of the kernels for a GPU architecture without that GPU:
it emulates the target, drives the real launchers as compile-only warmups and reads registers,
spills, shared memory, MMA kind and count from the compiled kernels; static compiler output, not
speed; the compile report ``python -m bench --what kernels`` and tests/kernels/test_kernel_structure.py
use it), ``hazards.py`` (divisions by a value that may be zero on the addresses of pipelined loads,
read from a compiled kernel's TTGIR: the compile report's hazards column and
tests/kernels/test_pipeline_hazards.py) and the tuner, ``python -m coreattn.tune``
(``__main__.py``): ``space.py`` (the classes and
candidates to tune), ``dryrun.py`` (every candidate compiled for an arch, no GPU), ``batches.py``
(the packed batches it times on), ``tuner.py`` (compile-check, time, rank, accept on the GPU),
``accept.py`` (the acceptance check against float64 and the shipped config), ``report.py`` (the
before/after table), ``isolated.py`` (the tasks in a worker process: a candidate that faults, dies
or hangs is dropped and a fresh worker goes on). The tuner writes kernels/tuned_cache.py's files;
the kernels read them.

May import: anything in coreattn (a tool above the public API, like ``coreattn.selfcheck``);
nothing in coreattn's kernels, layers or adapters imports it.
"""
