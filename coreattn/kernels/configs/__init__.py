"""Launch configurations, one file per concern and one table file per kernel family.

Which target a device is, each kernel family's tables per target, the tuner's candidates, and
which config a launch takes; a family's tables are found by its name:

- ``targets.py``: the targets (interpreter, the CUDA and CDNA archs, Ascend), which one a device
  is (``target_of``), the launch options every GPU launch sets (``MAXNREG``, ``FP_FUSION``,
  ``launch_options``), where the TMA variant runs, and Ascend's persistent grid and buffer budget;
- ``base.py``: ``AttnConfig`` (a tile, warps, stages and launch options), the head-dim blocks
  tables are keyed by, and the kernel names (``KERNELS``);
- ``dense.py``: the dense attention kernels' tables (forward, dK/dV, dQ, preprocess: CUDA, CDNA,
  fp32, dropout, the interpreter's, Ascend's sizing by on-chip bytes) and the launchers' entry
  points ``fwd_config``, ``bwd_configs``, ``preprocess_config``, ``split_dkdv``; each table's
  docstring and comments say what the compile report found for it;
- ``indexer.py``: the DSA indexer kernels' tables (the fused top-k, the Hadamard rotation);
- ``sparse.py``: the sparse (top-k) attention kernels' tables (kernels/sparse_fwd.py,
  sparse_bwd.py: forward, dQ, dK/dV partials, the CSR reduce and the delta preprocess; CUDA,
  CDNA, fp32, the interpreter's, Ascend's sizing by on-chip bytes) and their entry point
  ``sparse_config``, keyed by target, head dims and the GQA group; the tuner does not search them;
- ``space.py``: what ``python -m coreattn.tune`` may try per target and kernel (``candidates``)
  and the loop variants' constexprs (``loop_flags``);
- ``pick.py``: which config a launch uses, forced (the tuner) > tuned cache (CUDA,
  kernels/tuned_cache.py) > shipped table, what was picked (``record_configs``), and the fallback
  to the table when a tuned config fails to compile (``tuned_fallback``).

None of the tables has been timed: they come
from compiler output alone (``python -m bench --what kernels``, docs/compile-report.md).

May import: torch, triton and, of coreattn, ``coreattn.kernels`` only (as the package above). The
files import downward, with no circle (tests/test_layout.py checks both): ``targets`` and ``base``
nothing of coreattn's at module level; kernels/tuned_cache.py ``base``; ``pick`` ``base``,
``targets`` and tuned_cache; a table file ``base``, ``targets`` and ``pick``; ``space`` the table
files. Nothing is re-exported here: import a name from the file that holds it (``from
coreattn.kernels.configs.dense import fwd_config``), so there is one binding to read or monkeypatch.
"""
