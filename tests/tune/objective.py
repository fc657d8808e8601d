"""A trial script that trains nothing: its loss is a function of its parameters, reported 3 times.

``OBJECTIVE_SLEEP`` seconds pass between reports; ``crash=1`` makes it fail after the first.
"""

import os
import time

import phalanx as px

params = px.tune.params(x=0.0, y=1, crash=0)
value = (params["x"] - 2) ** 2 + params["y"]
for step in range(1, 4):
    if px.tune.report(step, loss=value + 1.0 / step):
        break
    if params["crash"]:
        raise RuntimeError("this trial crashes on purpose")
    time.sleep(float(os.environ.get("OBJECTIVE_SLEEP", "0")))
print("objective", params, value, flush=True)
