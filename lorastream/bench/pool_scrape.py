"""A ``/metrics`` scraper in a process of its own, as the endpoint picker is:
``python -m lorastream.bench.pool_scrape URL INTERVAL_S`` times ``GET URL`` every ``INTERVAL_S``
until its stdin closes, then prints one JSON object: ``samples``, a ``[seconds, requests
waiting]`` pair per scrape, and ``errors``. ``lorastream bench pool`` times a saturated worker's
``/metrics`` with it, so that the time measured is the worker's and the loopback's, not that of
the benchmark's own threads (its fronts and the streaming clients that saturate the worker).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from urllib.error import URLError

from lorastream.bench.endpoint_picker import extract


def scrape_until(url: str, interval_s: float, stop: threading.Event
                 ) -> tuple[list[tuple[float, bool]], int]:
    """Scrapes at a fixed rate, at least once, until ``stop``; ([seconds, requests waiting]
    each, errors)."""
    samples: list[tuple[float, bool]] = []
    errors = 0
    next_at = time.perf_counter()
    while True:
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        except (URLError, OSError):
            errors += 1
        else:
            samples.append((time.perf_counter() - started, extract(text).waiting_queue_size > 0))
        next_at += interval_s
        if stop.wait(max(0.0, next_at - time.perf_counter())):
            return samples, errors


def main(argv: list[str]) -> None:
    url, interval_s = argv[0], float(argv[1])
    stop = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        result["samples"], result["errors"] = scrape_until(url, interval_s, stop)

    thread = threading.Thread(target=run)
    thread.start()
    sys.stdin.read()  # until the parent closes it
    stop.set()
    thread.join()
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
