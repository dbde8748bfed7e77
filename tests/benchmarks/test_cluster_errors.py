"""The serving cluster's error lines are kept before Ray's scratch folder goes (`benchmarks/_cluster.py`)."""

from benchmarks._cluster import keep_errors


def test_the_lines_around_each_error_in_replica_and_serve_logs_are_kept(tmp_path):
    logs = tmp_path / "session_1" / "logs"
    (logs / "serve").mkdir(parents=True)
    (logs / "worker-1.err").write_text("start\nready\nTraceback (most recent call last):\n  File x\nOSError: disk\n")
    (logs / "serve" / "replica_LLMServer.log").write_text("a\nb\nERROR request r: capture failed (out of memory)\nc\n")
    (logs / "worker-2.err").write_text("all well\n")
    out = tmp_path / "errors.log"
    keep_errors(out, tmp_path, before=1, after=2)
    kept = out.read_text()
    assert "== worker-1.err:3\nready\nTraceback (most recent call last):\n  File x\nOSError: disk" in kept
    assert "== replica_LLMServer.log:3\nb\nERROR request r: capture failed (out of memory)\nc" in kept
    assert "all well" not in kept and "start" not in kept


def test_no_errors_leave_an_empty_file(tmp_path):
    (tmp_path / "session_1" / "logs").mkdir(parents=True)
    out = tmp_path / "errors.log"
    keep_errors(out, tmp_path)
    assert out.read_text() == ""
