"""coreattn/tune/hazards.py on small synthetic TTGIR: a division by a value that may be zero on an
asynchronous load's address chain is found (through loop induction variables, iter_args, scf.if
results and warp-specialized partitions); constant, argument and ``maxsi``-clamped divisors and
divisions off the address chain are not; TMA copies are counted, not scanned; each finding names
its source line. The snippets follow Triton 3.9's printed TTGIR; tests/kernels/test_pipeline_hazards.py
runs the scanner on the installed Triton's real output."""

import pytest

from coreattn.tune.hazards import Graph, load_counts, scan

HEAD = """#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], order = [1, 0]}>
#loc = loc("/src/k.py":6:1)
#loc1 = loc(unknown)
#loc7 = loc("/src/k.py":14:20)
#loc8 = loc("/src/k.py":30:8)
#loc9 = loc(callsite(#loc7 at #loc8))
#loc10 = loc("head"(#loc9))
#loc11 = loc("/src/k.py":16:12)
#loc12 = loc("a"(#loc11))
module attributes {"ttg.num-warps" = 4 : i32, ttg.target = "cuda:90"} {
  tt.func public @k(%x_ptr: !tt.ptr<f16> {tt.divisibility = 16 : i32} loc("x_ptr"(#loc)), %lo: i32 loc("lo"(#loc)), %hi: i32 loc("hi"(#loc)), %group: i32 loc("group"(#loc))) attributes {noinline = false} {
    %c0_i32 = arith.constant 0 : i32 loc(#loc1)
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %c15_i32 = arith.constant 15 : i32 loc(#loc1)
    %c16_i32 = arith.constant 16 : i32 loc(#loc1)
    %c4096_i32 = arith.constant 4096 : i32 loc(#loc1)
    %cst_0 = arith.constant dense<0.000000e+00> : tensor<16x64xf16, #blocked> loc(#loc1)
    %cst_1 = arith.constant dense<64> : tensor<16x64xi32, #blocked> loc(#loc1)
    %mask = arith.constant dense<true> : tensor<16x64xi1, #blocked> loc(#loc1)
    %n = arith.subi %hi, %lo : i32 loc(#loc1)
    %n_4 = arith.addi %n, %c15_i32 : i32 loc(#loc1)
    %n_5 = arith.divsi %n_4, %c16_i32 : i32 loc(#loc1)
    %buf = ttg.local_alloc : () -> !ttg.memdesc<2x16x64xf16, #shared, #smem, mutable> loc(#loc1)
"""
TAIL = """    tt.return loc(#loc)
  } loc(#loc)
} loc(#loc)
"""


def _load(ptr: str, name: str = "%a_34", indent: str = "      ") -> str:
    """An asynchronous load of a [16, 64] tile at ``x_ptr + ptr * 4096 + lanes``."""
    return (f"{indent}{name}_off = arith.muli {ptr}, %c4096_i32 : i32 loc(#loc1)\n"
            f"{indent}{name}_base = tt.addptr %x_ptr, {name}_off : !tt.ptr<f16>, i32 loc(#loc1)\n"
            f"{indent}{name}_ptrs = tt.splat {name}_base : !tt.ptr<f16> -> tensor<16x64x!tt.ptr<f16>, #blocked> loc(#loc1)\n"
            f"{indent}{name}_p = tt.addptr {name}_ptrs, %cst_1 : tensor<16x64x!tt.ptr<f16>, #blocked>, tensor<16x64xi32, #blocked> loc(#loc1)\n"
            f"{indent}{name}_s = ttg.memdesc_index %buf[%c0_i32] : !ttg.memdesc<2x16x64xf16, #shared, #smem, mutable> -> !ttg.memdesc<16x64xf16, #shared, #smem, mutable> loc(#loc1)\n"
            f"{indent}{name} = ttg.async_copy_global_to_local {name}_p, {name}_s mask %mask other %cst_0 {{contiguity = 8 : i32}} : tensor<16x64x!tt.ptr<f16>, #blocked> -> <16x64xf16, #shared, #smem, mutable> loc(#loc12)\n")


def _loop(divisor: str, body_extra: str = "") -> str:
    """The dK/dV kernel's shape: ``for step in range(n * group): head = step // divisor`` loading at head."""
    return ("    %ub = arith.muli %n_5, %group : i32 loc(#loc1)\n"
            "    scf.for %step = %c0_i32 to %ub step %c1_i32  : i32 {\n"
            f"      %head = arith.divsi %step, {divisor} : i32 loc(#loc10)\n"
            + body_extra + _load("%head") +
            "    } loc(#loc1)\n")


def test_division_by_a_computed_count_is_found_with_its_source():
    found = scan(HEAD + _loop("%n_5") + TAIL)
    assert len(found) == 1
    hz = found[0]
    assert (hz.op, hz.divisor, hz.source) == ("arith.divsi", "%n_5", "k.py:14 < k.py:30")
    assert [src for _, src in hz.loads] == ["k.py:16"]
    assert "arith.divsi by %n_5 at k.py:14 < k.py:30" in hz.describe()


def test_the_peeled_prologue_form_is_found():
    """What the pipeliner emits before the loop: iteration 1's address, ``1 // n``, outside any loop."""
    text = HEAD + "    %head = arith.divsi %c1_i32, %n_5 : i32 loc(#loc10)\n" + _load("%head", indent="    ") + TAIL
    assert [(h.op, h.divisor) for h in scan(text)] == [("arith.divsi", "%n_5")]


@pytest.mark.parametrize("divisor, setup", [
    ("%c16_i32", ""),  # a constant (what tl.cdiv(x, BLOCK) divides by)
    ("%group", ""),  # a kernel argument
    ("%n_6", "    %n_6 = arith.maxsi %n_5, %c1_i32 : i32 loc(#loc1)\n"),  # tl.maximum(n, 1)
    ("%n_7", "    %n_6 = arith.maxsi %c1_i32, %n_5 : i32 loc(#loc1)\n"
             "    %n_7 = arith.extsi %n_6 : i32 to i64 loc(#loc1)\n"),  # clamped, then widened
    ("%n_6", "    %n_6 = arith.select %c1_i32, %c16_i32, %group : i32 loc(#loc1)\n"),  # either is nonzero
], ids=["constant", "argument", "maxsi-clamped", "clamped-then-extended", "select-of-nonzero"])
def test_divisors_that_cannot_be_zero_are_not_flagged(divisor, setup):
    assert scan(HEAD + setup + _loop(divisor) + TAIL) == []


@pytest.mark.parametrize("setup", [
    "    %n_6 = arith.maxsi %n_5, %c0_i32 : i32 loc(#loc1)\n",  # clamped to >= 0 only
    "    %n_6 = arith.minsi %n_5, %c16_i32 : i32 loc(#loc1)\n",  # bounded above only
    "    %n_6 = arith.select %c1_i32, %c16_i32, %n_5 : i32 loc(#loc1)\n",  # one side may be 0
], ids=["maxsi-with-zero", "minsi", "select-with-a-maybe-zero"])
def test_clamps_that_allow_zero_are_flagged(setup):
    assert [h.divisor for h in scan(HEAD + setup + _loop("%n_6") + TAIL)] == ["%n_6"]


def test_divisions_off_the_address_chain_are_not_flagged():
    """A division that only feeds a mask, a store's address or nothing: the load's address does not
    depend on it (a wild mask cannot make cp.async fault; plain stores are not prefetched)."""
    body = ("      %q = arith.divsi %step, %n_5 : i32 loc(#loc1)\n"
            "      %qs = tt.splat %q : i32 -> tensor<16x64xi32, #blocked> loc(#loc1)\n"
            "      %m = arith.cmpi slt, %qs, %cst_1 : tensor<16x64xi32, #blocked> loc(#loc1)\n"
            "      %r = arith.remsi %step, %n_5 : i32 loc(#loc1)\n"
            "      %sp = tt.addptr %x_ptr, %r : !tt.ptr<f16>, i32 loc(#loc1)\n")
    text = HEAD + _loop("%c16_i32", body) + TAIL
    assert scan(text) == []
    assert load_counts(text) == dict(async_loads=1, tma_loads=0)


def test_chains_through_iter_args_yields_and_if_results():
    """The address is a loop-carried value: its initial value is clean, the value each iteration
    yields comes out of an scf.if whose else branch divides by a maybe-zero count."""
    text = HEAD + (
        "    %r:2 = scf.for %i = %c0_i32 to %n_5 step %c1_i32 iter_args(%arg5 = %c0_i32, %arg6 = %c1_i32) -> (i32, i32)  : i32 {\n"
        "      %cond = arith.cmpi slt, %i, %hi : i32 loc(#loc1)\n"
        "      %nxt = scf.if %cond -> (i32) {\n"
        "        scf.yield %arg6 : i32 loc(#loc1)\n"
        "      } else {\n"
        "        %d = arith.divui %i, %n : i32 loc(#loc10)\n"
        "        scf.yield %d : i32 loc(#loc1)\n"
        "      } loc(#loc1)\n"
        + _load("%arg5") +
        "      scf.yield %nxt, %arg6 : i32, i32 loc(#loc1)\n"
        "    } loc(#loc1)\n") + TAIL
    assert [(h.op, h.divisor) for h in scan(text)] == [("arith.divui", "%n")]


def test_sibling_regions_reuse_names():
    """MLIR prints the same names in sibling loops: each use must resolve to its own loop's value."""
    loop = ("    scf.for %step = %c0_i32 to %n_5 step %c1_i32  : i32 {{\n"
            "      %32 = arith.{op} %step, {divisor} : i32 loc(#loc1)\n"
            "{load}"
            "    }} loc(#loc1)\n")
    first = loop.format(op="divsi", divisor="%n_5", load="")  # divides by n, loads nothing
    second = loop.format(op="addi", divisor="%c1_i32", load=_load("%32"))  # loads at %32 = step + 1
    assert scan(HEAD + first + second + TAIL) == []
    assert len(scan(HEAD + second.replace("addi", "remsi").replace("%c1_i32 :", "%n_5 :") + first + TAIL)) == 1


def test_warp_specialized_partitions_read_their_captures():
    """A partition's arguments are the op's captures in order: a division outside the op reaches a
    load inside partition0 through its second argument."""
    text = HEAD + (
        "    %h = arith.divsi %hi, %n_5 : i32 loc(#loc10)\n"
        "    ttg.warp_specialize(%lo, %h, %x_ptr) attributes {requestedRegisters = array<i32: 24>}\n"
        "    default {\n"
        "      ttg.warp_yield loc(#loc1)\n"
        "    }\n"
        "    partition0(%arg9: i32 loc(\"lo\"(#loc)), %arg10: i32 loc(\"h\"(#loc)), %arg11: !tt.ptr<f16> loc(\"x_ptr\"(#loc))) num_warps(1) {\n"
        "      %c0_i32_1 = arith.constant 0 : i32 loc(#loc1)\n"
        "      %off = arith.muli %arg10, %arg9 : i32 loc(#loc1)\n"
        "      %base = tt.addptr %arg11, %off : !tt.ptr<f16>, i32 loc(#loc1)\n"
        "      %ptrs = tt.splat %base : !tt.ptr<f16> -> tensor<16x64x!tt.ptr<f16>, #blocked> loc(#loc1)\n"
        "      %cp = ttg.async_copy_global_to_local %ptrs, %buf mask %mask other %cst_0 : tensor<16x64x!tt.ptr<f16>, #blocked> -> <16x64xf16, #shared, #smem, mutable> loc(#loc12)\n"
        "      ttg.warp_return loc(#loc1)\n"
        "    } : (i32, i32, !tt.ptr<f16>) -> () loc(#loc1)\n") + TAIL
    found = scan(text)
    assert [(h.divisor, h.source) for h in found] == [("%n_5", "k.py:14 < k.py:30")]


def test_a_clamped_divisor_captured_by_a_partition_stays_clamped():
    """tl.maximum(n, 1) outside the warp-specialize op, divided by inside partition0 (the dK/dV
    kernel's warp-specialized query loop on sm100): not a hazard."""
    text = HEAD + (
        "    %c1_i32 = arith.constant 1 : i32 loc(#loc1)\n"
        "    %per = arith.maxsi %n_5, %c1_i32 : i32 loc(#loc10)\n"
        "    ttg.warp_specialize(%hi, %per, %x_ptr) attributes {requestedRegisters = array<i32: 24>}\n"
        "    default {\n"
        "      ttg.warp_yield loc(#loc1)\n"
        "    }\n"
        "    partition0(%arg9: i32 loc(\"hi\"(#loc)), %arg10: i32 loc(\"per\"(#loc)), %arg11: !tt.ptr<f16> loc(\"x_ptr\"(#loc))) num_warps(1) {\n"
        "      %h = arith.divsi %arg9, %arg10 : i32 loc(#loc10)\n"
        "      %base = tt.addptr %arg11, %h : !tt.ptr<f16>, i32 loc(#loc1)\n"
        "      %ptrs = tt.splat %base : !tt.ptr<f16> -> tensor<16x64x!tt.ptr<f16>, #blocked> loc(#loc1)\n"
        "      %cp = ttg.async_copy_global_to_local %ptrs, %buf mask %mask other %cst_0 : tensor<16x64x!tt.ptr<f16>, #blocked> -> <16x64xf16, #shared, #smem, mutable> loc(#loc12)\n"
        "      ttg.warp_return loc(#loc1)\n"
        "    } : (i32, i32, !tt.ptr<f16>) -> () loc(#loc1)\n") + TAIL
    assert scan(text) == []
    assert len(scan(text.replace("arith.maxsi %n_5, %c1_i32", "arith.addi %n_5, %c1_i32"))) == 1


def test_tma_copies_are_counted_not_scanned():
    """TMA coordinates are bounds-checked by the hardware: a division there is not a fault."""
    text = HEAD + (
        "    %h = arith.divsi %hi, %n_5 : i32 loc(#loc10)\n"
        "    %bar = ttg.local_alloc : () -> !ttg.memdesc<1xi64, #shared, #smem, mutable> loc(#loc1)\n"
        "    %true = arith.constant true loc(#loc1)\n"
        "    ttng.async_tma_copy_global_to_local %x_ptr[%h, %c0_i32] %buf, %bar, %true : !tt.tensordesc<16x64xf16>, "
        "!ttg.memdesc<1xi64, #shared, #smem, mutable> -> !ttg.memdesc<16x64xf16, #shared, #smem, mutable> loc(#loc12)\n"
    ) + TAIL
    assert scan(text) == []
    assert load_counts(text) == dict(async_loads=0, tma_loads=1)


def test_graph_resolves_every_name_and_constant():
    graph = Graph(HEAD + _loop("%n_5") + TAIL)
    assert graph.unresolved == []
    values = {n.text.split("=")[0].strip(): n.value for n in graph.nodes if n.op == "arith.constant"}
    assert values["%c16_i32"] == 16 and values["%cst_1"] == 64 and values["%mask"] == 1 and values["%cst_0"] is None
