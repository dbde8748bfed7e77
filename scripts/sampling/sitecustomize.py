"""Stack sampling in every Python process of a run (Ray replicas, vLLM's engine core), without ptrace.

Python imports `sitecustomize` at start-up from `sys.path`; with this folder first on PYTHONPATH and
INFERSCALE_SAMPLE_DIR set, each process starts a daemon thread that, every INFERSCALE_SAMPLE_MS (default 2),
records the stacks of its other threads while `<dir>/label` names a phase (a benchmark writes the label when a
phase starts and removes it after), and writes them to `<dir>/<pid>.json` every few seconds
(`scripts/stack_report.py` reads them). The `sitecustomize` this one shadows, if any, still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("INFERSCALE_SAMPLE_DIR"):
    sys.path.insert(0, _here)
    from stack_sampler import start

    sys.path.remove(_here)
    start(os.environ["INFERSCALE_SAMPLE_DIR"], float(os.environ.get("INFERSCALE_SAMPLE_MS", "2")))

_shadowed = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _shadowed is not None and _shadowed.loader is not None:
    _shadowed.loader.exec_module(importlib.util.module_from_spec(_shadowed))
