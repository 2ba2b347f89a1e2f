"""coreattn benchmark suite: ``python -m bench --help``.

Attention (forward, backward, forward+backward) of coreattn against the kernels users would use
instead, and the mask utilities against per-sample loops. Figures measured on CPU are labelled
"not performance data": the CPU path exists so the suite can be tested without a GPU.
"""
