"""The shape issue 48 asked of the code, kept: no function of the package outside nextn/ops/ takes
more than 7 parameters (a request's settings travel as one object, a step's buffers as one), and no
two sampling files share a run of 6 or more lines. Triton kernels (@triton.jit) are exempt: a
kernel's parameters are its pointers, strides and constexprs."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nextn"
MAX_PARAMETERS = 7


def _is_kernel(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_outside_ops_takes_more_than_7_parameters():
    wide = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "ops" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_kernel(node):
                if (n := _parameters(node)) > MAX_PARAMETERS:
                    wide.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n})")
    assert not wide, "functions over 7 parameters:\n" + "\n".join(wide)


def _runs(path: Path, size: int = 6) -> set[tuple[str, ...]]:
    """Every run of `size` consecutive lines (stripped) of a file's code, blank lines, bare brackets
    and imports left out (two modules may well import alike)."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    trivial = ("", ")", "]", "}", "):", "else:", "pass", '"""')
    lines = [line for line in lines if line not in trivial and not line.startswith(("import ", "from "))]
    return {tuple(lines[i : i + size]) for i in range(len(lines) - size + 1)}


def test_no_two_sampling_files_share_a_run_of_6_lines():
    files = sorted((PACKAGE / "sample").glob("*.py"))
    assert len(files) >= 5  # the package holds the pipeline, the sampler, the verifiers and the kernels
    runs = {f: _runs(f) for f in files}
    shared = [
        (a.name, b.name, next(iter(runs[a] & runs[b])))
        for i, a in enumerate(files)
        for b in files[i + 1 :]
        if runs[a] & runs[b]
    ]
    assert not shared, shared
