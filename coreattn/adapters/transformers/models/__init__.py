"""One module per transformers model family that coreattn runs with its own code (as transformers lays out
``models/<name>/``): each says which of the model's modules it wraps and the transformers source it was
written against, and refuses, naming the method, under a transformers whose wrapped code differs.

Owns: ``minimax_m3.py`` (MiniMax-M3, ``minimax_m3_vl``: its indexer's block-max top-k and its
block-sparse attention). The shared machinery (the attention function, the mask builder) is the
package root's.

May import: ``coreattn.kernels``, ``coreattn.layers`` and ``coreattn.adapters``; transformers inside
functions only.
"""
