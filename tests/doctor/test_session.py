"""The doctor's session files: a worker's record is whole or absent."""

from __future__ import annotations

from pathlib import Path

from tests.disk_full import run_until_full


def test_a_record_cut_off_mid_write_leaves_no_file_under_its_name(tmp_path: Path) -> None:
    done = run_until_full("""
        import sys
        from pathlib import Path
        from phalanx.doctor.session import Session

        session = Session(Path(sys.argv[1]), steps=1, warmup=0, deadline_s=60)
        session.recorder.events.extend(("step", float(i), {}) for i in range(1000))  # far over the limit
        fill_up_at(4096)
        session.finish(complete=False)
    """, str(tmp_path))
    assert "File too large" in done.stderr, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [], "a truncated record would fail the doctor's report as bad JSON"
