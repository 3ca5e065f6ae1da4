"""Start TransferQueue on the Ray cluster this container heads, and keep it up.

TransferQueue's controller and storage units are Ray actors owned by the process that
called ``transfer_queue.init()``: they live exactly as long as it does. So this
process initializes them, marks the container ready (a file the health check looks
for) and then only waits for SIGTERM. Storage units are pinned to nodes that offer
the ``tokentrail_storage`` resource (the head), so that stage processes joining the
cluster as Ray nodes never host rows they could take down with them on a restart.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import ray
import transfer_queue
from omegaconf import OmegaConf

READY_FILE = Path(os.environ.get("TOKENTRAIL_TQ_READY_FILE", "/tmp/transferqueue.ready"))
STORAGE_RESOURCE = "tokentrail_storage"


def main() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address="auto", namespace="transfer_queue", log_to_driver=False)
    units = int(os.environ.get("TOKENTRAIL_TQ_STORAGE_UNITS", "2"))
    conf = OmegaConf.create(
        {
            "backend": {
                "SimpleStorage": {
                    "num_data_storage_units": units,
                    "required_node_resource": STORAGE_RESOURCE,
                }
            }
        }
    )
    transfer_queue.init(conf)
    READY_FILE.write_text("ready\n")
    print(f"TransferQueue is up with {units} storage unit(s); waiting for SIGTERM", flush=True)
    stop.wait()
    READY_FILE.unlink(missing_ok=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
