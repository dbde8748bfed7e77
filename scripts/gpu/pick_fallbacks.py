"""Print the fallback wheels to install: those whose package is missing from the GPU image or whose image version
does not meet the range in fallback.txt; a chosen wheel's own requirements tighten the ranges of the others, until
nothing changes. Run WITHOUT PYTHONPATH, so that it sees the image's own packages:
    env -u PYTHONPATH python3 pick_fallbacks.py fallback.txt FALLBACK_WHEEL_DIR"""

import email.parser
import importlib.metadata as md
import os
import re
import sys
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name as canon
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name as canon


def requires(path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = email.parser.Parser().parsestr(z.read(meta).decode("utf-8", "replace"))
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


rows, needs = {}, {}
for line in open(sys.argv[1]):
    if line.strip() and not line.startswith("#"):
        wheel, name, spec = line.split()[:3]
        rows[canon(name)] = (wheel, name)
        needs[canon(name)] = SpecifierSet("" if spec == ">=0" else spec)
chosen, changed = {}, True
while changed:
    changed = False
    for key, (wheel, name) in sorted(rows.items()):
        if key in chosen:
            continue
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not needs[key].contains(have, prereleases=True):
            chosen[key] = wheel
            changed = True
            print(f"   fallback {name}: image has {have}, need {needs[key] or 'any'} -> {wheel}", file=sys.stderr)
            for r in requires(os.path.join(sys.argv[2], wheel)):
                if canon(r.name) in rows and (r.marker is None or r.marker.evaluate({"extra": ""})):
                    needs[canon(r.name)] &= r.specifier
for wheel in sorted(chosen.values()):
    print(wheel)
