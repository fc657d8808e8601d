"""Horovod's API on phalanx.

TorchDynamo is imported here, once per test process: torch imports it when the first optimizer is
made (about 2.3 s), so the workers the harness forks from this process for optimizer tests start
with it loaded instead of each paying for it. It starts no thread, so forking stays safe.
"""

import torch._dynamo  # noqa: F401
