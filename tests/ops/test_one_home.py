"""One fact, one home: a document's bounds and the accumulation dtype are each written once in the package
(`ops/pi/pattern.py: document_bounds`, `ops/pi/dtypes.py: accumulation_dtype`), checked from the source,
and the one function does what its callers need."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import piattn
from piattn.ops.pi.dtypes import accumulation_dtype
from piattn.ops.pi.pattern import document_bounds

SRC = Path(piattn.__file__).parent


def _trees():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _dtype_name(node) -> str | None:
    """"float32" for `torch.float32` (or a bare `float32`), else None."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _writes_the_accumulation_rule(node) -> bool:
    """Whether an expression spells the rule "fp64 stays fp64, everything else computes in fp32" itself."""
    if isinstance(node, ast.IfExp):
        # torch.float64 if x == torch.float64 else torch.float32 (either way round)
        if {_dtype_name(node.body), _dtype_name(node.orelse)} == {"float64", "float32"}:
            return True
        # s if s.dtype in (torch.float32, torch.float64) else s.float()
        test = node.test
        if (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.In)
                and isinstance(test.comparators[0], ast.Tuple)
                and {_dtype_name(e) for e in test.comparators[0].elts} == {"float32", "float64"}):
            return True
    # torch.promote_types(x.dtype, torch.float32): "at least fp32"
    if isinstance(node, ast.Call) and _dtype_name(node.func) == "promote_types":
        return any(_dtype_name(a) == "float32" for a in node.args)
    return False


def test_document_bounds_is_defined_once():
    """No backend keeps its own copy (an int32 one for Triton, a CPU one for "fused"): one function, with
    the index dtype and device as arguments."""
    defined = [(path, node.name) for path, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("document_bounds")]
    assert defined == [("ops/pi/pattern.py", "document_bounds")]


def test_the_accumulation_rule_is_written_once():
    written = sorted({path for path, tree in _trees() for node in ast.walk(tree)
                      if _writes_the_accumulation_rule(node)})
    assert written == ["ops/pi/dtypes.py"]
    defined = [path for path, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef) and node.name == "accumulation_dtype"]
    assert defined == ["ops/pi/dtypes.py"]


def test_the_scan_sees_each_form_of_the_rule():
    forms = ["torch.float64 if q.dtype == torch.float64 else torch.float32",
             "torch.float32 if q.dtype != torch.float64 else torch.float64",
             "s if s.dtype in (torch.float32, torch.float64) else s.float()",
             "torch.promote_types(q.dtype, torch.float32)"]
    for form in forms:
        assert any(map(_writes_the_accumulation_rule, ast.walk(ast.parse(form)))), form
    for other in ["x.float()", "torch.float32 if fast else torch.bfloat16", "torch.promote_types(a, b)"]:
        assert not any(map(_writes_the_accumulation_rule, ast.walk(ast.parse(other)))), other


def test_accumulation_dtype():
    assert accumulation_dtype(torch.float64) == torch.float64
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert accumulation_dtype(dtype) == torch.float32
        # the same as "at least fp32", the form the baseline layers used to write
        assert accumulation_dtype(dtype) == torch.promote_types(dtype, torch.float32)


def test_document_bounds():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5], [1, 2, 1, 1, 3, 3]])
    start, end = document_bounds(ids)
    assert start.tolist() == [[0, 0, 0, 3, 3, 5], [0] * 6, [0, 1, 2, 2, 4, 4]]
    assert end.tolist() == [[3, 3, 3, 5, 5, 6], [6] * 6, [1, 2, 4, 4, 6, 6]]
    assert start.dtype == end.dtype == torch.int64
    assert document_bounds(None) == (None, None)
    for dtype in (torch.int32, torch.int64):
        for t in document_bounds(ids.to(torch.int16), dtype, device="cpu"):
            assert t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        assert [t.tolist() for t in document_bounds(ids, dtype)] == [start.tolist(), end.tolist()]
    # ids given as a view (a column slice): the bounds are still contiguous, as the kernels read them
    view = torch.cat([ids, ids], 1)[:, ::2]
    assert all(t.is_contiguous() for t in document_bounds(view, torch.int32))


def test_a_period_is_spread_over_the_heads_in_one_place():
    """One function turns a period setting into one period per query head (`validate.head_periods`): the
    operator's entry, the layers, inspection and sequence parallelism ask it; no other module keeps a copy."""
    names = {"head_periods", "per_head", "period_values", "layer_period"}
    defined = [(path, node.name) for path, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef) and node.name in names]
    assert defined == [("ops/pi/validate.py", "head_periods")]


def test_head_periods():
    from piattn.ops.pi.validate import head_periods

    assert head_periods(16, 4) == (16, 16, 16, 16)
    assert head_periods([8, 16, 8, 16], 4) == head_periods(torch.tensor([8, 16, 8, 16]), 4) == (8, 16, 8, 16)
    assert head_periods((6, 6), 2) == (6, 6)
    with pytest.raises(ValueError, match="period has 3 entries; per-head periods need one per query head, n_heads=4"):
        head_periods((3, 8, 5), 4, count="n_heads")
