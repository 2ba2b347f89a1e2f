"""Compile the kernels of the given problems for CUDA or AMD CDNA architectures, without a device, and print
coreattn.tune.compiler's rows as JSON (run as a script; TRITON_INTERPRET must be unset).

``python tests/kernels/kernel_structure.py sm90:64,128,192/128 sm86:256,128@fp32 gfx90a:64+max_logit``:
arch, then head dims (q/k[/v], ``@fp32`` for fp32 inputs, ``+FEATURE`` for one of compiler.FEATURES),
each compiled causal, in bf16 unless told (the causal kernels hold both the masked and unmasked key
loops). ``s576/512a128``, ``s128/128g4``: the sparse kernels (compiler.sparse_problem_of: absorbed with
128 q heads, GQA group 4).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

from coreattn.tune.compiler import Problem, compile_report, sparse_problem_of  # noqa: E402


def main(specs: list[str]) -> None:
    rows = []
    for spec in specs:
        arch, _, dims = spec.partition(":")
        problems = []
        for dim in dims.split(","):
            dim, _, feature = dim.partition("+")
            dim, _, dtype = dim.partition("@")
            if dim.startswith("s"):
                problems.append(sparse_problem_of(dim[1:], dtype or "bf16"))
                continue
            qk, _, v = dim.partition("/")
            problems.append(Problem(int(qk), int(v or qk), dtype or "bf16", True, feature=feature))
        rows += compile_report([arch], problems)
    json.dump(rows, sys.stdout, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
