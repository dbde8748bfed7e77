"""Replica slots: distinct while held, the same one again after its holder is gone."""

import subprocess
import sys

from kvcore.replica_slot import claim_slot, release_slot


def test_holders_get_distinct_slots_and_a_successor_gets_the_freed_one(tmp_path):
    first, second = claim_slot(tmp_path, host="h"), claim_slot(tmp_path, host="h")
    assert (first.name, second.name) == ("h-slot0", "h-slot1") and first.path.is_dir()
    release_slot(first)
    assert claim_slot(tmp_path, host="h").name == "h-slot0"
    release_slot(second)


def test_a_slot_held_by_another_process_is_skipped_until_it_exits(tmp_path):
    code = (
        "import sys, time; from kvcore.replica_slot import claim_slot; "
        f"print(claim_slot({str(tmp_path)!r}, host='h').name, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "h-slot0"
        mine = claim_slot(tmp_path, host="h")
        assert mine.name == "h-slot1"
        release_slot(mine)
    finally:
        child.kill()
        child.wait()
    after = claim_slot(tmp_path, host="h")  # the child died: its slot (and disk tier) is free again
    assert after.name == "h-slot0"
    release_slot(after)
