"""On the GPU machine, after install.sh: walk the serving stack's requirements as the interpreter sees them (honours
PYTHONPATH, so /tmp/site shadows the image) and report what is missing or of a version outside the range.
    PYTHONPATH=/tmp/site python3 check_deps.py
The roots and the deliberate gaps are closure.py's (the same check, made on the wheels at build time).
Prints 'no unexpected problems' or the list; the exit status is always 0 (it only reports)."""

import importlib.metadata as md
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from closure import NO_DEPS, OPTIONAL_ROOTS, ROOTS, SKIPPED, TRUSTED, Requirement, canon  # noqa: E402


def get(name):
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def where(d):
    try:
        return str(d.locate_file(""))
    except Exception:
        return "?"


seen, problems, expected = set(), [], []
stack = [
    (Requirement(r), "<root>")
    for r in ROOTS
    if canon(Requirement(r).name) not in OPTIONAL_ROOTS or get(Requirement(r).name) is not None
]
while stack:
    req, who = stack.pop()
    key = canon(req.name)
    d = get(req.name)
    if d is None:
        (expected if key in SKIPPED else problems).append(f"MISSING   {req}  (needed by {who})")
        continue
    if req.specifier and not req.specifier.contains(d.version, prereleases=True):
        msg = f"MISMATCH  {req}  (needed by {who}); have {d.version} from {where(d)}"
        (expected if key in SKIPPED or key in TRUSTED else problems).append(msg)
        continue
    node = (key, frozenset(req.extras))
    if node in seen or key in NO_DEPS:
        continue
    seen.add(node)
    for raw in d.requires or []:
        r = Requirement(raw)
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in (sorted(req.extras) or [""])):
            stack.append((r, f"{d.metadata['Name']} {d.version}"))

print(f"checked {len(seen)} (package, extras) nodes reachable from {len(ROOTS)} roots")
for n in (
    "vllm",
    "ray",
    "torch",
    "numpy",
    "protobuf",
    "setuptools",
    "transformers",
    "tokenizers",
    "huggingface-hub",
    "fastapi",
    "starlette",
    "pydantic",
    "redis",
    "locust",
    "gevent",
    "openai",
    "aiohttp",
    "grpcio",
):
    dd = get(n)
    print(f"  {n:16s} {dd.version if dd else '-':14s} {where(dd) if dd else ''}")
if expected:
    print(
        f"{len(set(expected))} expected gaps (optional vLLM kernels not carried, image packages trusted as they are):"
    )
    for m in sorted(set(expected)):
        print("  ", m)
if problems:
    print(f"{len(set(problems))} UNEXPECTED problems:")
    for m in sorted(set(problems)):
        print("  ", m)
else:
    print("no unexpected problems")
