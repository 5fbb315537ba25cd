"""Load exported models in a fresh interpreter that imports only TensorFlow, Keras and NumPy.

``python -I`` (no PYTHONPATH, no script or working directory on sys.path), run from a scratch
directory; the script reports any downpour or test module that got
imported anyway, so a test can assert that the export needs none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

LOADER = r"""
import json, sys
import numpy as np
import tensorflow as tf
import keras

jobs = json.loads(sys.argv[1])
out = {}
for job in jobs:
    data = np.load(job["npz"])
    x, y = data["x"], data["y"]
    if job["format"] == "keras":
        model = keras.models.load_model(job["path"], compile=False)
        fn = lambda b: model(b, training=False)
    else:
        loaded = tf.saved_model.load(job["path"])  # kept: it owns the variables
        fn = loaded.serve
    logits = np.concatenate([np.asarray(fn(x[i : i + 500])) for i in range(0, len(x), 500)])
    out[job["path"]] = float(np.mean(np.argmax(logits, axis=-1) == y))
ours = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("downpour", "tiny_models", "dtype_models", "conftest")
)
print(json.dumps({"accuracy": out, "downpour_modules": ours}))
"""


def save_eval_data(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    """Held-out examples for the loader, as an .npz of ``x`` and ``y``."""
    np.savez(path, x=x, y=y)
    return path


def plain_tf_accuracy(jobs: list[dict[str, str]], cwd: Path, timeout: float = 120) -> dict:
    """Run LOADER on ``jobs`` ({path, format: keras|saved_model, npz}); its JSON answer."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.run(
        [sys.executable, "-I", "-c", LOADER, json.dumps(jobs)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
