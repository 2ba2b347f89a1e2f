"""Pipelined-load address hazards in a compiled kernel's TTGIR: divisions by a value that may be zero.

Why: with num_stages >= 2 Triton's software pipeliner turns a loop's loads into asynchronous copies
(``ttg.async_copy_global_to_local``: cp.async on NVIDIA; on AMD's gfx950 the direct-to-LDS
``amdg.buffer_load_to_local``, ``amdgpu.`` before Triton 3.9; CDNA's tables use num_stages 1, so
none appear there today) and issues
them ahead: it peels the first iterations into a prologue that runs even when the loop runs zero
times, and prefetches iterations past the loop's end, guarded only by the load masks. A masked-off
cp.async still takes its address, and one outside the tensor faults ("Warp illegal address" on an
H100, Triton 3.6). An integer division on the GPU by zero is not 0 but garbage, so an address
built from ``step // n`` with ``n == 0`` (an empty range: the loop runs zero times, but its
prologue still forms iteration 0's address) is wild: coreattn's dK/dV kernel faulted that way
(issue 30).

What: ``scan(ttgir)`` finds every asynchronous load (``ASYNC_LOADS``), walks the definition chain
of its address operands back through every operand of every op (loads, scf.for induction
variables and iter_args with their initial and yielded values, scf.if results, warp-specialized
partitions' captures), and reports each integer division or remainder (``DIVISIONS``) on that
chain whose divisor is not provably nonzero (``Graph.nonzero``): a nonzero constant, a kernel
argument (assumed nonzero: the launchers divide only by head counts and lengths they guard),
``arith.maxsi`` /
``arith.maxui`` with an operand >= 1 (what ``tl.maximum(x, 1)`` compiles to; ``tl.cdiv(x, C)``
divides by the constant C), a select of two such values, or a cast, splat, broadcast or layout
change of one. TMA copies (``ttng.async_tma_copy_global_to_local``) are left out: the hardware
checks their coordinates against the descriptor's bounds (out of bounds reads zeros, never
faults), and the descriptor is a kernel argument built on the host. Plain ``tt.load`` is left out
too: a prefetched plain load is predicated off as a whole (no address is touched), which is what
cp.async's zero-fill does not do.

What it cannot see: an address that is wild for a reason other than such a division (a row past
the tensor that no mask or clamp stops: the interpreter memcheck, tests/interp_memcheck.py, finds
those in the iterations it runs), values that pass through shared memory, and loads that a later
Triton pipelines differently. It reads the TTGIR as Triton prints it; the format assumptions, each
checked on Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0 (tests/kernels/test_pipeline_hazards.py compiles
real kernels with the installed Triton and would fail on a change):
  - one op per line, ``%results = dialect.op operands... loc(...)`` or ``"dialect.op"(...)``, a
    region opened by a line ending in ``{`` and closed by a line starting with ``}``;
  - result groups ``%x:N`` used as ``%x#i``; names scoped per region (sibling loops reuse them);
  - ``scf.for %iv = %lb to %ub step %s iter_args(%a = %init, ...)`` with ``scf.yield`` last;
  - ``ttg.warp_specialize(%captures...)`` followed by ``default {`` and ``partitionN(%args: ...) {``
    regions whose arguments are the captures in order;
  - ``#locN = loc(...)`` aliases with ``"file":line:col``, ``callsite(a at b)`` and ``"name"(loc)``
    (for the source lines named in a report);
  - the op names in ``ASYNC_LOADS``, ``TMA_LOADS`` and ``DIVISIONS``.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

# asynchronous (pipelined) global -> shared loads whose masked-off lanes still take an address;
# operand 0 is the pointer tensor (amdgpu's buffer forms: base pointer, then the offsets)
ASYNC_LOADS = ("ttg.async_copy_global_to_local", "amdgpu.buffer_load_to_local", "amdg.buffer_load_to_local")
TMA_LOADS = ("ttng.async_tma_copy_global_to_local", "ttng.async_tma_gather", "tt.descriptor_load",
             "tt.descriptor_gather")
DIVISIONS = ("arith.divsi", "arith.divui", "arith.remsi", "arith.remui", "arith.floordivsi", "arith.ceildivsi",
             "arith.ceildivui")
# ops whose result is nonzero when their first operand is (value-preserving or broadcasting)
_SAME_VALUE = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "arith.extsi", "arith.extui",
               "arith.index_cast", "ttg.convert_layout")
_MAX = ("arith.maxsi", "arith.maxui")
_TERMINATORS = ("scf.yield", "scf.condition", "ttg.warp_yield", "ttg.warp_return", "tt.return",
                "tt.reduce.return", "tt.scan.return")

_NAME = r"%[A-Za-z0-9_.$-]+"
_REF = re.compile(_NAME + r"(?:#\d+)?")
_DEF = re.compile(rf"^({_NAME}(?::\d+)?(?:\s*,\s*{_NAME}(?::\d+)?)*)\s*=\s*\"?([A-Za-z_][\w.]*)\"?(.*)$")
_OP = re.compile(r"^\"?([A-Za-z_][\w.]*)\"?(.*)$")
_FOR = re.compile(rf"^scf\.for\s+({_NAME})\s*=\s*({_NAME}(?:#\d+)?)\s+to\s+({_NAME}(?:#\d+)?)\s+step\s+"
                  rf"({_NAME}(?:#\d+)?)(.*)$")
_BLOCK_ARG = re.compile(rf"({_NAME})\s*:")
_LOC_ALIAS = re.compile(r"^(#loc\d*)\s*=\s*(loc\(.*\))\s*$")
_LOC_START = re.compile(r"(?<![\w.])loc\(")


class Hazard(NamedTuple):
    """A division or remainder on an asynchronous load's address chain whose divisor may be zero."""

    op: str  # arith.divsi, arith.remsi, ...
    divisor: str  # the divisor's SSA name (Triton names values after the Python variable: %n_blocks_88)
    line: int  # the division's line in the TTGIR
    source: str  # where the division comes from: "file.py:LINE < caller.py:LINE ...", "" if unknown
    loads: tuple  # (TTGIR line, source) of each asynchronous load it feeds

    def describe(self) -> str:
        src = self.source or "unknown source"
        loads = "; ".join(f"{s or '?'} (TTGIR line {n})" for n, s in self.loads[:2])
        more = f"; and {len(self.loads) - 2} more" if len(self.loads) > 2 else ""
        return (f"{self.op} by {self.divisor} at {src} (TTGIR line {self.line}) feeds the address of "
                f"{len(self.loads)} asynchronous load(s): {loads}{more}")


class _Node:
    __slots__ = ("op", "operands", "refs", "line", "loc", "text", "yields", "value")

    def __init__(self, op, operands, refs, line, loc, text):
        self.op, self.operands, self.refs = op, list(operands), list(refs)  # refs: the names operands were read from
        self.line, self.loc, self.text = line, loc, text
        self.yields: list[list[int]] = []  # a region owner's terminators' operands, region by region
        self.value = None  # arith.constant: its integer value (None: not an integer scalar or splat)


class Graph:
    """The values of a TTGIR module: each SSA value a node whose operands are the values it is
    computed from, names resolved per region scope (MLIR reuses names in sibling regions)."""

    def __init__(self, ttgir: str):
        self.nodes: list[_Node] = []
        self.loc_aliases: dict[str, str] = {}
        self.loads: list[_Node] = []  # the asynchronous loads
        self.tma_loads = 0
        self.unresolved: list[tuple[int, str]] = []  # (line, name) of operands defined nowhere visible
        self._scopes: list[dict] = []
        self._owners: list = []  # the op node whose region each scope is (None: module, function)
        self._pending: list = []  # per scope: the last ttg.warp_specialize op, for its regions that follow
        self._patches: list = []  # (nodes, owner, kind): to link to the owner's yields once parsed
        self._parse(ttgir)

    # -- building

    def _new(self, op, operands=(), refs=(), line=0, loc="", text="") -> int:
        self.nodes.append(_Node(op, operands, refs, line, loc, text))
        return len(self.nodes) - 1

    def _resolve(self, ref: str) -> int | None:
        name, _, idx = ref.partition("#")
        for scope in reversed(self._scopes):
            if name in scope:
                ids = scope[name]
                return ids[min(int(idx or 0), len(ids) - 1)]
        return None

    def _refs(self, text: str, line: int) -> tuple[list[int], list[str]]:
        ids, names = [], []
        for ref in _REF.findall(_strip_locs(text)):
            nid = self._resolve(ref)
            if nid is None:
                self.unresolved.append((line, ref))
                continue
            ids.append(nid)
            names.append(ref)
        return ids, names

    def _open(self, owner, block_args=()) -> None:
        self._scopes.append({name: [nid] for name, nid in block_args})
        self._owners.append(owner)
        self._pending.append(None)

    def _close(self):
        if len(self._scopes) <= 1:
            return None
        self._scopes.pop()
        self._pending.pop()
        return self._owners.pop()

    def _parse(self, ttgir: str) -> None:
        self._open(None)
        for lineno, raw in enumerate(ttgir.splitlines(), 1):
            line = raw.strip()
            m = _LOC_ALIAS.match(line)
            if m:
                self.loc_aliases[m.group(1)] = m.group(2)
            elif line and not line.startswith(("#", "//")):
                self._line(line, lineno)
        for nodes, owner, kind in self._patches:
            for i, nid in enumerate(nodes):
                if kind == "indexed":  # result i / iter_arg i: the i-th value of each terminator
                    self.nodes[nid].operands += [y[i] for y in owner.yields if i < len(y)]
                else:  # an op this parser does not know the regions of: every value its regions yield
                    self.nodes[nid].operands += [v for y in owner.yields for v in y]

    def _line(self, line: str, lineno: int) -> None:
        loc = _loc_of(line)
        if line.startswith("}"):
            owner = self._close()
            if line.endswith("{") and owner is not None:  # "} else {", "} do {"
                self._open(owner)
            return
        if line.startswith("^"):  # a block label: its arguments come from the region owner's operands
            owner = self._owners[-1]
            src = owner.operands if owner is not None else []
            for name in _BLOCK_ARG.findall(_strip_locs(line.partition("(")[2])):
                self._scopes[-1][name] = [self._new("block_arg", src, (), lineno, loc, line)]
            return
        if line.startswith("default {"):  # ttg.warp_specialize's default region
            self._open(self._pending[-1])
            return
        m = re.match(r"^partition\d+\((.*)\)\s*num_warps", line)
        if m:  # a warp-specialized partition: its arguments are the op's captures, in order
            ws = self._pending[-1]
            captures = ws.operands if ws is not None else []
            args = [(name, self._new("partition_arg", [captures[i]] if i < len(captures) else captures, (), lineno,
                                     loc, line))
                    for i, name in enumerate(_BLOCK_ARG.findall(_strip_locs(m.group(1))))]
            self._open(ws, args)
            return
        if line.startswith("tt.func"):
            self._open(None, [(name, self._new("arg", (), (), lineno, loc, name))
                              for name in _BLOCK_ARG.findall(_strip_locs(line.partition("(")[2]))])
            return
        if line.startswith("module"):
            self._open(None)
            return
        m = _DEF.match(line)
        if m:
            names, op, rest = m.groups()
        else:
            m = _OP.match(line)
            if m is None:
                return
            names, (op, rest) = "", m.groups()
        opens = line.endswith("{")
        if op in _TERMINATORS:
            owner = self._owners[-1]
            if owner is not None:
                owner.yields.append(self._refs(rest, lineno)[0])
            return
        results = []  # (name, first result index, count)
        total = 0
        for part in (p.strip() for p in names.split(",") if p.strip()):
            name, _, count = part.partition(":")
            results.append((name, total, int(count or 1)))
            total += int(count or 1)
        if op == "scf.for" and opens:
            self._for(results, rest, lineno, loc, line)
            return
        carried = []
        if op == "scf.while":  # scf.while (%a = %init, ...): the before region's arguments
            carried = re.findall(rf"({_NAME})\s*=\s*({_NAME}(?:#\d+)?)", _strip_locs(rest.partition(")")[0]))
            rest = rest.partition(")")[2]
        operands, refs = self._refs(rest, lineno)
        nid = self._new(op, operands, refs, lineno, loc, line)
        node = self.nodes[nid]
        if op == "arith.constant":
            node.value = _constant(rest)
        if op in ASYNC_LOADS:
            self.loads.append(node)
        elif op in TMA_LOADS:
            self.tma_loads += 1
        if opens or op == "ttg.warp_specialize":
            group = [self._new(op + ".result", [nid], (), lineno, loc, line) for _ in range(total)]
            known = op in ("scf.if", "ttg.warp_specialize")
            self._patches.append((group, node, "indexed" if known else "all"))
        else:
            group = [nid] * total
        for name, first, count in results:
            self._scopes[-1][name] = group[first:first + count]
        if op == "ttg.warp_specialize":
            self._pending[-1] = node
        if opens:
            args = []
            for name, init in carried:
                init_id = self._resolve(init)
                args.append((name, self._new("scf.while.arg", [init_id] if init_id is not None else [], (), lineno,
                                             loc, line)))
            self._patches.append(([a for _, a in args], node, "all"))
            self._open(node, args)

    def _for(self, results, rest, lineno, loc, line) -> None:
        m = _FOR.match("scf.for" + rest)
        if m is None:
            raise ValueError(f"TTGIR line {lineno}: unrecognised scf.for: {line[:200]}")
        iv, lb, ub, step, tail = m.groups()
        bounds, refs = self._refs(" ".join((lb, ub, step)), lineno)
        owner = self.nodes[self._new("scf.for", bounds, refs, lineno, loc, line)]
        args = [(iv, self._new("scf.for.iv", bounds, refs, lineno, loc, line))]
        carried = []
        im = re.search(r"iter_args\((.*?)\)\s*->", _strip_locs(tail))
        for name, init in re.findall(rf"({_NAME})\s*=\s*({_NAME}(?:#\d+)?)", im.group(1) if im else ""):
            operands, refs = self._refs(init, lineno)
            carried.append(self._new("scf.for.iter_arg", operands, refs, lineno, loc, line))
            args.append((name, carried[-1]))
        self._patches.append((carried, owner, "indexed"))  # then what each iteration yields
        for name, first, count in results:  # the loop's results: its carried values
            self._scopes[-1][name] = [self._new("scf.for.result", carried[i:i + 1], (), lineno, loc, line)
                                      for i in range(first, first + count)]
        self._open(owner, args)

    # -- reading

    def source(self, node: _Node, depth: int = 3) -> str:
        """Where a node comes from: ``file.py:LINE`` of its location's innermost frame, then its
        callers' (``attn_bwd.py:180 < attn_bwd.py:252 < attn_bwd.py:326``); "" if unknown."""
        return " < ".join(f"{os.path.basename(f)}:{n}" for f, n in self.frames(node.loc)[:depth])

    def frames(self, loc: str, depth: int = 0) -> list[tuple[str, int]]:
        """(file, line) frames of a ``loc(...)`` text, innermost first."""
        loc = loc.strip()
        if not loc or depth > 64:
            return []
        if loc.startswith("loc(") and loc.endswith(")"):
            loc = loc[4:-1].strip()
        if loc.startswith("#loc"):
            return self.frames(self.loc_aliases.get(loc, ""), depth + 1)
        m = re.match(r'^"([^"]*)":(\d+)(?::\d+)?', loc)
        if m:
            return [(m.group(1), int(m.group(2)))]
        if loc.startswith("callsite(") and loc.endswith(")"):
            callee, _, caller = _split_top(loc[len("callsite("):-1], " at ")
            return self.frames(callee, depth + 1) + self.frames(caller, depth + 1)
        if loc.startswith("fused") and "[" in loc:
            return self.frames(_split_top(loc[loc.index("[") + 1:loc.rindex("]")], ",")[0], depth + 1)
        m = re.match(r'^"[^"]*"\((.*)\)$', loc)  # a name: "x"(#loc12)
        return self.frames(m.group(1), depth + 1) if m else []

    def nonzero(self, nid: int) -> bool:
        """The value can be shown never to be 0 (see the module docstring)."""
        return self._bound(nid, 0, set())

    def _bound(self, nid: int, at_least: int, seen: set) -> bool:
        """at_least 0: provably nonzero; 1: provably >= 1."""
        if (nid, at_least) in seen:
            return False
        seen.add((nid, at_least))
        node = self.nodes[nid]
        if node.op == "arith.constant":
            return node.value is not None and (node.value >= 1 if at_least else node.value != 0)
        if node.op == "arg":
            return True
        if node.op in _SAME_VALUE and node.operands:
            return self._bound(node.operands[0], at_least, seen)
        if node.op == "partition_arg" and len(node.operands) == 1:  # a warp-specialized partition's capture
            return self._bound(node.operands[0], at_least, seen)
        if node.op in _MAX:
            return any(self._bound(o, 1, seen) for o in node.operands)
        if node.op == "arith.select" and len(node.operands) == 3:
            return all(self._bound(o, at_least, seen) for o in node.operands[1:])
        return False


def _strip_locs(text: str) -> str:
    """Text without its ``loc(...)`` parts (nested parentheses and quoted names included)."""
    out, i = [], 0
    while True:
        m = _LOC_START.search(text, i)
        if m is None:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:m.start()])
        depth, k = 0, m.end() - 1
        while k < len(text):
            c = text[k]
            if c == '"':
                k = text.find('"', k + 1)
                k = len(text) if k < 0 else k
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        i = k + 1


def _loc_of(line: str) -> str:
    """The op's own location: the last ``loc(...)`` on the line."""
    j = line.rfind(" loc(")
    return line[j + 1:].strip() if j >= 0 else ""


def _split_top(text: str, sep: str) -> tuple[str, str, str]:
    """Split at the first ``sep`` outside parentheses and brackets."""
    depth = 0
    for i, c in enumerate(text):
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            return text[:i], sep, text[i + len(sep):]
    return text, "", ""


def _constant(rest: str) -> int | None:
    """The integer of ``arith.constant 16 : i32``, ``dense<16> : tensor<...xi32>`` or a boolean
    (``true``, ``dense<true>``: 1); None for a float or anything else."""
    m = re.match(r"^\s*(?:dense<)?(true|false)\b", rest)
    if m:
        return int(m.group(1) == "true")
    m = re.match(r"^\s*(?:dense<)?(-?\d+)>?\s*:\s*(?:tensor<[^>]*x)?i\d+", rest)
    return int(m.group(1)) if m else None


def address_operands(node: _Node) -> list[int]:
    """The operands of an asynchronous load that form its address: the pointer tensor
    (``ttg.async_copy_global_to_local %ptr, %dst mask %m other %x``) or, in amdgpu's buffer form,
    the base pointer and the offsets (``%base[%offsets]``)."""
    return node.operands[:2 if node.op.endswith(".buffer_load_to_local") else 1]


def scan(ttgir: str | Graph) -> list[Hazard]:
    """Every division on an asynchronous load's address chain whose divisor may be 0, one per
    division op (with the loads it feeds), in TTGIR order."""
    graph = ttgir if isinstance(ttgir, Graph) else Graph(ttgir)
    found: dict[int, list] = {}
    for node in graph.loads:
        stack, seen = address_operands(node), set()
        while stack:
            nid = stack.pop()
            if nid in seen:
                continue
            seen.add(nid)
            cur = graph.nodes[nid]
            if cur.op in DIVISIONS and len(cur.operands) >= 2 and not graph.nonzero(cur.operands[1]):
                found.setdefault(nid, []).append(node)
            stack.extend(cur.operands)
    hazards = []
    for nid, loads in sorted(found.items(), key=lambda kv: graph.nodes[kv[0]].line):
        div = graph.nodes[nid]
        hazards.append(Hazard(div.op, div.refs[1] if len(div.refs) > 1 else "?", div.line, graph.source(div),
                              tuple((ld.line, graph.source(ld, 2)) for ld in sorted(loads, key=lambda x: x.line))))
    return hazards


def load_counts(ttgir: str | Graph) -> dict:
    """How many asynchronous (pipelined) loads and TMA loads the TTGIR has."""
    graph = ttgir if isinstance(ttgir, Graph) else Graph(ttgir)
    return dict(async_loads=len(graph.loads), tma_loads=graph.tma_loads)
