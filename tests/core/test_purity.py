"""The KV core imports only torch, numpy, the standard library and itself."""

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "kvcore"
ALLOWED = {"torch", "numpy", "kvcore"} | set(sys.stdlib_module_names)


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_core_imports_only_torch_numpy_and_stdlib():
    files = sorted(CORE.glob("**/*.py"))
    assert len(files) >= 8
    offenders = {str(f.relative_to(CORE)): sorted(_imported_roots(f) - ALLOWED) for f in files}
    assert {name: bad for name, bad in offenders.items() if bad} == {}


def test_the_walker_catches_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom transformers import AutoModel\nimport vllm.config\n")
    assert _imported_roots(bad) - ALLOWED == {"transformers", "vllm"}
