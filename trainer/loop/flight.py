"""The flight recorder's contents on request: the last collectives this rank issued, for a hang's diagnosis.

torch.distributed keeps every collective of every process group in a ring
buffer (``TORCH_FR_BUFFER_SIZE`` entries; the supervisor sets it): operation,
sequence number, sizes, and whether it was scheduled, started or completed.
When the watchdog finds a hang or a desync it asks the ranks for it before the
teardown, through a request file in the attempt's folder; this thread writes
``flight-rank{R}.json`` beside it. A thread, because the rank's main thread is
the one that is stuck; it sends no beacon, so it never makes a stuck rank look
alive.
"""

from __future__ import annotations

import logging
import os
import threading

from trainpipe.trainer.protocol import flight_path, flight_request_path

log = logging.getLogger("trainpipe.trainer")


class FlightRecorderDump(threading.Thread):
    def __init__(self, out_dir: str, rank: int, every_s: float = 0.2):
        super().__init__(name="flight-recorder-dump", daemon=True)
        self.out_dir, self.rank, self.every_s = out_dir, rank, every_s
        self._stop = threading.Event()

    def run(self) -> None:
        request = flight_request_path(self.out_dir)
        while not self._stop.wait(self.every_s):
            if os.path.exists(request):
                self.dump()
                return

    def dump(self) -> None:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # pyright: ignore[reportAttributeAccessIssue]

        try:
            trace = _dump_fr_trace_json(True, False)
            path = flight_path(self.out_dir, self.rank)
            with open(f"{path}.tmp", "wb") as fh:
                fh.write(trace if isinstance(trace, bytes) else trace.encode())
            os.replace(f"{path}.tmp", path)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never be what fails the rank
            log.warning("flight recorder dump failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
