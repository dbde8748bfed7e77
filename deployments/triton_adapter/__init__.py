"""Triton kernels of the serving path: every `triton` import lives here."""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger(__name__)


def optional_kernel(module: str, name: str) -> Any:
    """`name` from `deployments.triton_adapter.<module>` (a kernel or its factory), or None where Triton is not
    installed (the caller's torch path then)."""
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ImportError as exc:
        log.info("Triton kernel %s unavailable: %s", name, exc)
        return None
