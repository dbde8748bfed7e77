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


def test_layers_import_downward_and_adapters_hold_their_library():
    """tenants sees only the core (never deployments, cluster or models); redis stays in its adapters (the
    `tenants/redis_*` modules, and every one of them imports it), and only the
    retrieval benchmark imports faiss, to compare it (retrieval is a matrix product: tenants/vector_index.py)."""
    root = CORE.parent
    tenants = {str(f.relative_to(root)): _imported_roots(f) for f in sorted((root / "tenants").glob("*.py"))}
    assert tenants and not {
        name for name, roots in tenants.items() if roots & {"deployments", "cluster", "models", "vllm", "ray"}
    }
    with_redis = {name for name, roots in tenants.items() if "redis" in roots}
    assert with_redis == {name for name in tenants if name.startswith("tenants/redis_")} and len(with_redis) == 5
    packages = (
        "kvcore",
        "models",
        "config",
        "tenants",
        "encoder_jobs",
        "deployments",
        "cluster",
        "loadtest",
        "benchmarks",
    )
    everything = {
        str(f.relative_to(root)): _imported_roots(f) for pkg in packages for f in sorted((root / pkg).rglob("*.py"))
    }
    assert {name for name, roots in everything.items() if "faiss" in roots} == {"benchmarks/retrieval.py"}
