"""The rules of programmatic dependent launch (aserve/kernels/pdl.py), checked in the source of every kernel module:
a Triton kernel that takes USE_PDL calls gdc_sync (or hands USE_PDL to a jit function that does), and a launch passes
USE_PDL=pdl.ENABLED exactly where it passes **pdl.launch_kwargs(). (A kernel launched with PDL but never waiting
could read what the kernel before it has not yet written; one launched without it loses the overlap.)"""

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "aserve" / "kernels"


def _jit_functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def test_every_pdl_kernel_waits_and_every_pdl_launch_passes_both():
    problems = []
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "pdl.py":
            continue
        tree = ast.parse(path.read_text())
        for fn in _jit_functions(tree):
            if "USE_PDL" not in [a.arg for a in fn.args.args]:
                continue
            calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
            waits = any(ast.unparse(c.func).endswith("gdc_sync") for c in calls)
            hands_on = any(isinstance(a, ast.Name) and a.id == "USE_PDL" for c in calls for a in c.args)
            if not (waits or hands_on):
                problems.append(f"{path.name}: {fn.name} takes USE_PDL but never calls gdc_sync")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            use = any(k.arg == "USE_PDL" and ast.unparse(k.value) == "pdl.ENABLED" for k in call.keywords)
            launch = any(k.arg is None and "launch_kwargs" in ast.unparse(k.value) for k in call.keywords)
            if use != launch:
                problems.append(f"{path.name}:{call.lineno}: USE_PDL=pdl.ENABLED {use}, **pdl.launch_kwargs() {launch}")
    assert problems == []
