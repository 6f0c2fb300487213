"""Every error graphar raises of its own lives in graphar/errors.py under GrapharError, and the public
API exports the ones a caller catches."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import graphar
from graphar import errors

ROOT = Path(__file__).resolve().parent.parent


def _defines_an_exception(node: ast.ClassDef) -> bool:
    names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    return any(n.endswith(("Error", "Exception", "Unavailable")) for n in names)


def test_every_exception_class_is_defined_in_errors() -> None:
    elsewhere = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for top in ("graphar", "passes")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path != ROOT / "graphar" / "errors.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and _defines_an_exception(node)
    ]
    assert elsewhere == []


def test_every_error_is_a_graphar_error() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) == 7 and all(issubclass(c, errors.GrapharError) for c in classes)
    # What callers caught before there was a base still catches them.
    assert issubclass(errors.SettingError, ValueError) and issubclass(errors.GrapharUnavailable, RuntimeError)
    assert issubclass(errors.GrapharCudaError, errors.GrapharCommError)  # a failed library call: a comm error
    assert issubclass(errors.GrapharTimeoutError, errors.GrapharCommError)


def test_the_public_api_exports_the_errors_a_caller_catches() -> None:
    for name in ("GrapharError", "GrapharCommError", "GrapharTimeoutError", "GrapharCudaError", "SettingError"):
        assert name in graphar.__all__ and getattr(graphar, name) is getattr(errors, name)
