"""Run Python code in a child process whose files cannot grow past a limit: a disk full mid-write.

With ``RLIMIT_FSIZE`` a write past the limit fails with ``EFBIG`` (``SIGXFSZ`` is ignored), after
the bytes up to the limit were written, as when a disk fills up or a writer dies mid-file.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PREAMBLE = textwrap.dedent("""
    import resource, signal

    def fill_up_at(limit):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
""")


def run_until_full(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (which calls ``fill_up_at(bytes)`` once its imports are done) with ``args``."""
    return subprocess.run([sys.executable, "-c", _PREAMBLE + textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=120)
