"""One replica of the digits MLP, as a serving process of a fleet: attaches the model to the
store named by ``PGC_STORE_URL`` (work dir ``PGC_WORK_DIR``), serves its own traffic from two
threads, checking every answer's top-1 against fp32, and on SIGTERM prints one JSON line
``{"calls", "failed", "wrong", "serving"}`` and exits. Run by tests/pgc_daemon_tests/test_fleet.py."""

from __future__ import annotations

import json
import signal
import sys
import threading

import torch

import pgc_daemon
from pgc_daemon.examples import digits


def main() -> int:
    spec = digits.mlp()
    model, inputs = spec["model"], [x for (x,) in spec["example_inputs"]]
    with torch.inference_mode():
        expected = [model(x).argmax(-1) for x in inputs]
    served = pgc_daemon.attach(model, name="digits-mlp", spec="pgc_daemon.examples.digits:mlp", metric="top1")
    stop = threading.Event()
    counts = {"calls": 0, "failed": 0, "wrong": 0}
    lock = threading.Lock()

    def traffic(seed: int) -> None:
        i = seed
        while not stop.is_set():
            k = i % len(inputs)
            try:
                agree = (served(inputs[k]).argmax(-1) == expected[k]).float().mean().item()
                with lock:
                    counts["calls"] += 1
                    counts["wrong"] += int(agree < 0.85)
            except Exception:  # noqa: BLE001 - counted: a failed request is what the test looks for
                with lock:
                    counts["failed"] += 1
            i += 1
            stop.wait(0.005)

    threads = [threading.Thread(target=traffic, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    for t in threads:
        t.join(timeout=10)
    serving = served.slot.label
    served.close()
    print(json.dumps({**counts, "serving": serving}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
