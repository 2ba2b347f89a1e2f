"""32-bit stride products in the pointer offsets of a compiled kernel's TTGIR (issue 36).

Why: Triton passes an integer kernel argument as i32 unless its value needs 64 bits, and an i32
product stays i32: ``base + offs[:, None] * stride`` (offs an int32 lane vector) multiplies in 32
bits and hands the wrapped value to ``tt.addptr``, which sign-extends it. Once
``stride * (rows - 1)`` reaches 2**31 (an sbhd token stride B*H*D of 16.9M elements with 128-row
tiles) the kernel reads or writes the wrong address, silently or with an illegal-address fault.
The kernels' ``INT64_LANES`` variant (kernels/attn_common.py ``_lane_offsets``) forms those
products in int64, and the launchers pick it when a stride needs it (``int64_lanes``).

What: ``scan(ttgir)`` walks back from the offset operand of every ``tt.addptr`` (and of AMD's buffer
ops, ``amdg.buffer_load %base[%offsets]`` and the like, ``amdgpu.`` before Triton 3.9, into which
Triton's HIP backend turns loads and stores whose offsets are i32) through the ops
that pass an offset's value along (``arith.addi``/``subi``, ``arith.select``'s values, splats,
broadcasts, expand_dims, layout changes, reshapes, transposes, sign/zero extensions, loop-carried
values, branch results and warp-specialized partitions' captures) and reports each i32
``arith.muli`` (scalar or tensor) it reaches that has a *runtime factor*: an operand that is a
pure function (through those moves and +, -, *) of kernel arguments and constants, i.e. a stride
or size the launcher passes. The other operand may be anything: a lane vector, a loop counter, a
constant (``p += BLOCK_N * stride`` wraps too). Not reported:

  * multiplies on i64 (``offs.to(tl.int64) * stride``): the INT64_LANES variant's;
  * i32 products without a runtime factor (``offs * HEAD_DIM`` with a constexpr, a stride that
    Triton specialized to 1): constants in TTGIR;
  * ``(y // n) * n`` (a remainder's ``row - b * rows_per_batch``): no larger than y;
  * products that reach the address only as a factor of an i64 multiply, or through a division,
    min/max or compare: index math, not offset terms.

The same reading of TTGIR as coreattn/tune/hazards.py (its ``Graph``: names scoped per region,
loop-carried values linked to what each iteration yields); the project tool
``ttgir_i32_offsets.py`` that found the sites first applies the same rules to a cache directory.
What it cannot see: a product that passes through memory, and an i32 index that overflows by
itself (a sequence-local index is below 2**31; the kernels add it to pointers only with a
stride of 1, as lse's and the keep masks' bases are).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from coreattn.tune.hazards import Graph, _strip_locs

# ops whose result is their first operand's value (a broadcast or a change of type or layout)
_MOVES = ("tt.splat", "tt.broadcast", "tt.expand_dims", "ttg.convert_layout", "tt.reshape", "tt.trans",
          "arith.extsi", "arith.extui")
# values that stand for another (the graph links them to their initial and yielded values)
_CARRIED = ("scf.for.iter_arg", "scf.for.result", "partition_arg", "block_arg", "scf.while.arg")
_TERMS = _MOVES + ("arith.addi", "arith.subi", "arith.select")  # an offset's value passes through these
_FACTORS = _MOVES + ("arith.addi", "arith.subi", "arith.muli", "arith.select")  # a runtime factor is built with these
_I32 = re.compile(r"^(?:tensor<(?:\d+x)*)?i32\b")
_BUFFER_OFFSETS = re.compile(r"%[\w$.\-]+\[(%[\w$.\-]+(?:#\d+)?)\]")  # amdg.buffer_*: %base[%offsets]


class Site(NamedTuple):
    """An i32 multiply with a runtime factor whose product is an additive term of a pointer offset:
    one per source location (the innermost line and its inlined callers), which the pipeliner and
    the column blocks may have copied into several ops."""

    line: int  # the first such multiply's line in the TTGIR
    source: str  # "file.py:LINE < caller.py:LINE ...", "" if unknown
    expr: str  # "offs_r * stride_t": Triton names values after the Python variables
    type: str  # "i32" or "tensor<...xi32>"
    ops: int  # how many multiply ops come from that location

    def describe(self) -> str:
        ops = f", {self.ops} ops" if self.ops > 1 else ""
        return f"{self.expr} [{self.type}{ops}] at {self.source or 'unknown source'} (TTGIR line {self.line})"


def _carried(op: str) -> bool:
    return op in _CARRIED or op.endswith(".result")


def _result_type(text: str) -> str:
    """The result type of a one-result op's line: what follows the last top-level `` : ``."""
    return _strip_locs(text).rpartition(" : ")[2].strip()


def _is_i32(node) -> bool:
    return bool(_I32.match(_result_type(node.text)))


def _factors(graph: Graph, nid: int, memo: dict) -> set | None:
    """The kernel arguments a value is a pure function of (empty: a constant), or None when it also
    depends on anything else (a lane index, the program id, a load, a loop counter)."""
    if nid in memo:
        return memo[nid]  # None while in progress on a cycle's way back: not a pure function
    node = graph.nodes[nid]
    if node.op == "arg":
        return {nid}
    if node.op == "arith.constant":
        return set()
    if node.op not in _FACTORS:
        return None
    memo[nid] = None
    found = [_factors(graph, o, memo) for o in (node.operands[1:] if node.op == "arith.select" else node.operands)]
    memo[nid] = None if None in found else set().union(*found)
    return memo[nid]


def _root(graph: Graph, nid: int) -> int:
    """The value with moves (splats, broadcasts, layout changes, extensions) stripped."""
    while graph.nodes[nid].op in _MOVES and graph.nodes[nid].operands:
        nid = graph.nodes[nid].operands[0]
    return nid


def _bounded(graph: Graph, a: int, b: int) -> bool:
    """a * b is (y // n) * n, no larger than y."""
    for q, n in ((a, b), (b, a)):
        d = graph.nodes[_root(graph, q)]
        if d.op in ("arith.divsi", "arith.divui") and len(d.operands) == 2 and \
                _root(graph, d.operands[1]) == _root(graph, n):
            return True
    return False


def _label(graph: Graph, nid: int) -> str:
    """The Python variable Triton named a value after, or a constant's value."""
    node = graph.nodes[_root(graph, nid)]
    if node.op == "arith.constant":
        return str(node.value) if node.value is not None else "const"
    m = re.match(r"^\s*(%[\w$.\-]+)", node.text if node.op != "arg" else node.text + " ")
    name = m.group(1) if m else "?"
    return re.sub(r"_\d+$", "", name.lstrip("%"))


def address_offsets(node) -> list[int]:
    """The offset operand of an address op: ``tt.addptr``'s second, an AMD buffer op's ``[%offsets]``."""
    if node.op == "tt.addptr":
        return node.operands[1:2]
    if ".buffer_" in node.op and node.op.startswith(("amdg.", "amdgpu.")):
        m = _BUFFER_OFFSETS.search(_strip_locs(node.text))
        if m and m.group(1) in node.refs:
            return [node.operands[node.refs.index(m.group(1))]]
    return []


def scan(ttgir: str | Graph) -> list[Site]:
    """Every i32 stride product on a pointer offset, one per source location, in TTGIR order."""
    graph = ttgir if isinstance(ttgir, Graph) else Graph(ttgir)
    products: set[int] = set()
    for node in graph.nodes:
        stack, seen = address_offsets(node), set()
        while stack:
            nid = stack.pop()
            if nid in seen:
                continue
            seen.add(nid)
            cur = graph.nodes[nid]
            if cur.op == "arith.muli":
                if _is_i32(cur):
                    products.add(nid)
            elif cur.op in _TERMS:
                stack.extend(cur.operands[1:] if cur.op == "arith.select" else cur.operands)
            elif _carried(cur.op):
                stack.extend(cur.operands)
    sites: dict = {}
    for nid in sorted(products, key=lambda n: graph.nodes[n].line):
        node = graph.nodes[nid]
        if len(node.operands) != 2:
            continue
        a, b = node.operands
        memo: dict = {}
        if _bounded(graph, a, b) or not (_factors(graph, a, memo) or _factors(graph, b, memo)):
            continue
        key = tuple(graph.frames(node.loc)) or (node.line,)
        if key in sites:
            sites[key] = sites[key]._replace(ops=sites[key].ops + 1)
            continue
        kind = _result_type(node.text)
        kind = kind.split(",")[0] + ">" if kind.startswith("tensor<") else kind
        sites[key] = Site(node.line, graph.source(node, depth=4), f"{_label(graph, a)} * {_label(graph, b)}", kind, 1)
    return list(sites.values())


def counts(ttgir: str | Graph) -> dict:
    """``i32_offsets``: how many such sites a kernel has (the compile report's column), and each."""
    found = scan(ttgir)
    return dict(i32_offsets=len(found), i32_offset_sites=[s.describe() for s in found])
