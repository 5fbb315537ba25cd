"""Stream one full epoch of a file example's ``input_fn`` and report the process's peak RSS.

    python tests/stream_epoch.py MODULE DATA_DIR

Prints one JSON line: the examples and batches read, the peak resident set size in MiB
(``VmHWM`` of /proc/self/status, and ``ru_maxrss``), and the RSS after TensorFlow was imported
and before the first batch. The memory test runs it once on a small data set and once on a
large one: if the pipeline streams, the two peaks are close.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def status_mib(field: str) -> float:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def main(module_name: str, data_dir: str) -> None:
    from downpour import InputContext

    module = importlib.import_module(module_name)
    ctx = InputContext(seed=0, data_dir=data_dir, batch_size=50)
    ready_mib = status_mib("VmRSS")
    examples = batches = 0
    t0 = time.monotonic()
    for _, labels in module.input_fn(ctx):
        examples += int(labels.shape[0])
        batches += 1
    print(
        json.dumps(
            {
                "examples": examples,
                "batches": batches,
                "seconds": round(time.monotonic() - t0, 1),
                "ready_rss_mib": round(ready_mib, 1),
                "peak_rss_mib": round(status_mib("VmHWM"), 1),
                "ru_maxrss_mib": round(
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
                ),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
