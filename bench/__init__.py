"""coreattn benchmark suite: ``python -m bench --help``.

Attention (forward, backward, forward+backward) of coreattn against the kernels users would use
instead, and the mask utilities against per-sample loops. Figures measured on CPU are labelled
"not performance data": the CPU path exists so the suite can be tested without a GPU. On a GPU
the sections run in a worker process that a CUDA fault cannot take the run down with
(``bench/isolation.py``). ``python -m bench.acceptance`` (``bench/acceptance.py``) is the one-command
GPU check: the isolated self-check, the GPU and CUDA tests and a short bench, in a time budget.
"""
