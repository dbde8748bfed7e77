"""A request's path inside the app, whatever prefix the app is served under.

Ray Serve mounts an application at its `route_prefix` by setting the ASGI `root_path` to it, and the request's
`path` keeps the prefix (`/b/v1/chat/completions` for an app at `/b`). Whatever compares a path with the app's own
routes must take the prefix off first, or an app served at a prefix is treated as if no chat ever arrived.
"""

from __future__ import annotations

from typing import Any, Mapping


def route_path(scope: Mapping[str, Any]) -> str:
    """`scope["path"]` without the `root_path` the app is mounted at (the path as the app's routes name it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path
