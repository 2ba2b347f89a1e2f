"""The DSA lightning indexer's ops (issue 38): top-k selection, the indexer loss and the Hadamard
rotation, on every device, in memory linear in the token count.

Owns: ``ops.py`` (the public functions ``indexer_topk``, ``indexer_loss``, ``indexer_topk_and_loss``,
``hadamard_transform``, ``rotate_activation``), ``checks.py`` (their argument checks and the key bounds
they derive), ``function.py`` (the loss's and the Hadamard transform's autograd, the backend choice).
The kernels are coreattn/kernels/indexer_topk.py and coreattn/kernels/hadamard.py, the torch backends
coreattn/layers/torch_backend/indexer_topk.py, indexer_loss.py and hadamard.py.

May import: torch, ``coreattn.kernels``, ``coreattn.layers.backends``, ``coreattn.layers.checks`` and
``coreattn.layers.torch_backend``.
"""

from coreattn.layers.dsa.indexer.ops import (IndexerTopk, hadamard_transform, indexer_loss, indexer_topk,
                                         indexer_topk_and_loss, rotate_activation)

__all__ = ["IndexerTopk", "indexer_topk", "indexer_loss", "indexer_topk_and_loss", "hadamard_transform",
           "rotate_activation"]
