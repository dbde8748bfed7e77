"""Cut the GPU wheelhouse into parts of at most PART_MIB MiB (default 60), so that one part plus the working tree fits
in one 64 MiB device transfer.
    python3 make_parts.py DIR
Takes DIR/wheels (installed always: group main), DIR/wheels_fallback (installed only where the image needs them:
group fallback) and DIR/files (other payloads, e.g. the redis-server tarball: group file). Files larger than a part
are cut with `split` into pieces of PART_MIB - 1 MiB; pieces and whole files are bin-packed first-fit decreasing
(then evened out) into DIR/parts/partNN. part01 also carries the manifests (parts.txt, pieces.sha256, files.sha256),
fallback.txt and the install scripts, so `bash parts/part01/install.sh` works without the repository too."""

import hashlib
import os
import re
import shutil
import subprocess
import sys

W = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".gpu")
HERE = os.path.dirname(os.path.abspath(__file__))
MIB = int(os.environ.get("PART_MIB", "60"))
CAP = MIB * 1024 * 1024
PIECE = CAP - 1024 * 1024  # pieces of a split file stay 1 MiB under a part, so no part is full to the byte
SCRIPTS = ["install.sh", "pick_fallbacks.py", "check_deps.py", "closure.py"]
META_RESERVE = 512 * 1024  # room kept in part01 for scripts + manifests
PARTS, STAGE = f"{W}/parts", f"{W}/split_stage"
GROUPS = (("main", f"{W}/wheels"), ("fallback", f"{W}/wheels_fallback"), ("file", f"{W}/files"))


def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def name_version(fn):
    if fn.endswith(".whl"):
        a = fn.split("-")
        return a[0], a[1]
    m = re.match(r"(.+?)-(\d[^-]*?)\.(tar\.gz|tgz|tar)$", fn)
    return (m.group(1), m.group(2)) if m else (fn, "-")


def pack(items, k=None):
    """First-fit decreasing; with k, worst-fit decreasing into k bins (None if something does not fit)."""
    bins = [{"used": 0, "items": []} for _ in range(k or 0)]
    for it in sorted(items, key=lambda t: -t["size"]):
        cands = [b for b in bins if b["used"] + it["size"] <= CAP]
        if k:
            if not cands:
                return None
            b = min(cands, key=lambda b: b["used"])
        elif cands:
            b = cands[0]
        else:
            b = {"used": 0, "items": []}
            bins.append(b)
        b["items"].append(it)
        b["used"] += it["size"]
    return bins


shutil.rmtree(PARTS, ignore_errors=True)
shutil.rmtree(STAGE, ignore_errors=True)
os.makedirs(PARTS)
os.makedirs(STAGE)

file_rows, items = [], []
for group, d in GROUPS:
    for fn in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        p = f"{d}/{fn}"
        size = os.path.getsize(p)
        n, v = name_version(fn)
        file_rows.append((group, fn, size, sha(p), n, v))
        if size > CAP:
            subprocess.run(["split", "-b", str(PIECE), "-d", "-a", "3", p, f"{STAGE}/{fn}.part"], check=True)
            for i, x in enumerate(sorted(x for x in os.listdir(STAGE) if x.startswith(fn + ".part"))):
                items.append(
                    {
                        "kind": "PIECE",
                        "src": f"{STAGE}/{x}",
                        "fn": x,
                        "size": os.path.getsize(f"{STAGE}/{x}"),
                        "idx": i,
                        "target": fn,
                        "group": group,
                    }
                )
        else:
            items.append({"kind": "WHOLE", "src": p, "fn": fn, "size": size, "group": group})
if len({r[1] for r in file_rows}) != len(file_rows):
    sys.exit("the same file name is in two groups")

bins = pack(items)
even = pack(items, len(bins))  # the same number of parts, evened out, so that no part is packed to the byte
bins = even or bins
bins.sort(key=lambda b: b["used"])
if bins[0]["used"] + META_RESERVE > CAP:  # no room for the scripts anywhere: they get a part of their own
    bins.insert(0, {"used": 0, "items": []})
named = [(f"part{i + 1:02d}", b) for i, b in enumerate([bins[0]] + sorted(bins[1:], key=lambda b: -b["used"]))]

whole_rows, piece_rows, piece_sums = [], [], []
for name, b in named:
    os.makedirs(f"{PARTS}/{name}")
    for it in b["items"]:
        dst = f"{PARTS}/{name}/{it['fn']}"
        if it["kind"] == "PIECE":
            shutil.move(it["src"], dst)
        elif os.stat(it["src"]).st_dev == os.stat(PARTS).st_dev:
            os.link(it["src"], dst)
        else:
            shutil.copy2(it["src"], dst)
        s = sha(dst)
        piece_sums.append(f"{s}  {name}/{it['fn']}")
        if it["kind"] == "PIECE":
            piece_rows.append(
                (
                    it["target"],
                    it["idx"],
                    f"PIECE {name} {it['fn']} {it['idx']} {it['target']} {it['size']} {s} {it['group']}",
                )
            )
        else:
            whole_rows.append(f"WHOLE {name} {it['fn']} {it['size']} {s} {it['group']}")
piece_rows.sort()

lines = [
    "# GPU wheelhouse for cp312 / manylinux x86_64: vLLM 0.26.0 + the serving extras + redis-server (scripts/gpu)",
    "# PART  <dir> <bytes-of-payload> <files>",
    "# WHOLE <dir> <file> <bytes> <sha256> <group>",
    "# PIECE <dir> <piece> <index> <file-it-belongs-to> <bytes> <sha256> <group>   (cat pieces in index order)",
    "# FILE  <group> <file> <bytes> <sha256> <name> <version>",
    "#   groups: main = wheels always installed; fallback = wheels installed only where the image needs them",
    "#   (fallback.txt); file = other payloads (the redis-server tarball)",
]
lines += [f"PART {name} {b['used']} {len(b['items'])}" for name, b in named]
lines += sorted(whole_rows) + [r[2] for r in piece_rows]
lines += [f"FILE {g} {fn} {size} {s} {n} {v}" for g, fn, size, s, n, v in file_rows]
with open(f"{W}/parts.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
with open(f"{W}/pieces.sha256", "w") as f:
    f.write("\n".join(sorted(piece_sums, key=lambda x: x.split()[1])) + "\n")
with open(f"{W}/files.sha256", "w") as f:
    f.write("\n".join(f"{s}  {fn}" for g, fn, size, s, n, v in file_rows) + "\n")
for fn in SCRIPTS:
    shutil.copy2(f"{HERE}/{fn}", f"{PARTS}/part01/{fn}")
for fn in ("fallback.txt", "parts.txt", "pieces.sha256", "files.sha256"):
    shutil.copy2(f"{W}/{fn}", f"{PARTS}/part01/{fn}")
shutil.rmtree(STAGE)

total = 0
for name, _ in named:
    files = os.listdir(f"{PARTS}/{name}")
    tot = sum(os.path.getsize(f"{PARTS}/{name}/{x}") for x in files)
    total += tot
    print(f"  {name}: {tot / 2**20:6.2f} MiB, {len(files):3d} files")
    assert tot <= CAP, f"{name} is over {MIB} MiB"
print(f"{len(named)} parts, {total / 2**20:.1f} MiB in all ({total} bytes), each <= {MIB} MiB")
