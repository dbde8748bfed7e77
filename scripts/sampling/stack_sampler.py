"""An in-process statistical profiler: a daemon thread samples `sys._current_frames()` while a phase label is set.

Used where no ptrace-based profiler can attach (the GPU machine runs under gVisor). The sampler needs the GIL
to look, so a thread that never releases it is seen at its switch points: `start` shortens the switch interval
to a quarter of the sampling interval, so samples stay spread over the code that runs rather than piling up
on the calls that release the GIL.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

MAX_DEPTH = 80
FLUSH_S = 3.0
LABEL_CHECK_S = 0.05


def _frame_name(frame) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{code.co_name}"


def _stack(frame) -> str:
    names = []
    while frame is not None and len(names) < MAX_DEPTH:
        names.append(_frame_name(frame))
        frame = frame.f_back
    return ";".join(reversed(names))


def _title() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return " ".join(sys.argv)[:300]


class Sampler:
    """Samples every thread's Python stack at an interval and counts them per labelled phase."""

    def __init__(self, folder: Path, interval_s: float) -> None:
        self._folder = folder
        self._interval = interval_s
        self._counts: Counter = Counter()  # (label, thread name, stack) -> samples
        self._label = ""
        self._label_mtime = 0.0
        self._checked = 0.0
        self._dirty = False

    def _current_label(self, now: float) -> str:
        if now - self._checked >= LABEL_CHECK_S:
            self._checked = now
            flag = self._folder / "label"
            try:
                mtime = flag.stat().st_mtime
                if mtime != self._label_mtime:
                    self._label, self._label_mtime = flag.read_text().strip(), mtime
            except OSError:
                self._label, self._label_mtime = "", 0.0
        return self._label

    def run(self) -> None:
        me = threading.get_ident()
        flushed = time.monotonic()
        while True:
            time.sleep(self._interval)
            now = time.monotonic()
            label = self._current_label(now)
            if label:
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, frame in sys._current_frames().items():
                    if ident != me:
                        self._counts[(label, names.get(ident, str(ident)), _stack(frame))] += 1
                self._dirty = True
            if self._dirty and now - flushed >= FLUSH_S:
                self.flush()
                flushed = now

    def flush_pending(self) -> None:
        if self._dirty:
            self.flush()

    def flush(self) -> None:
        rows = [[label, thread, stack, n] for (label, thread, stack), n in self._counts.items()]
        target = self._folder / f"{os.getpid()}.json"
        scratch = target.with_suffix(".tmp")
        scratch.write_text(
            json.dumps({"pid": os.getpid(), "title": _title(), "interval_s": self._interval, "rows": rows})
        )
        scratch.replace(target)
        self._dirty = False


def start(folder: str, interval_ms: float) -> None:
    """Start sampling this process into `folder` (created if missing)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    # a busy thread yields the GIL every switch interval (5 ms by default): shorter, so a sample lands near its
    # time instead of at the next blocking call (which a default interval over-counts)
    sys.setswitchinterval(min(sys.getswitchinterval(), interval_ms / 4000))
    sampler = Sampler(path, interval_ms / 1000)
    threading.Thread(target=sampler.run, name="stack-sampler", daemon=True).start()
    atexit.register(sampler.flush_pending)
