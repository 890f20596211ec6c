"""Session-wide test setup.

Triton reads ``TRITON_INTERPRET`` when it is first imported and when kernels are defined; some
libraries (transformers, torch) import Triton early, so the variable is set here, before any
test module is imported. These machines have no GPU: Triton kernels run in the interpreter.

Workers built or started by tests take their host budget's pages on demand: taken at start
(``--host-memory-prefault``, the default) the default 4 GiB would be resident per worker, and
the test process holds many. ``tests/worker/loading/test_fetch_process.py`` turns it on where it
checks it.

Stores built or started by tests may stage local adapters from the temporary directory (where
the tests make them); a store allows no local path unless given roots. Tests of the roots
themselves pass ``allowed_local_roots`` explicitly.

Workers built or started by tests take LoadAdapter and UnloadAdapter without a token, as they did
before a worker with no token refused them; ``tests/worker/service/test_worker_auth.py`` checks
the refusal with ``insecure_no_auth=False``.

Workers and stores started by tests as processes serve their metrics on a free port: on the
defaults (9452, 9451) two at once on this machine would refuse to start.
"""

import os
import tempfile

# `make test`'s branch coverage per package and its floors (--coverage-floors).
pytest_plugins = ["tests.support.coverage_floors"]

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LORASTREAM_WORKER_HOST_MEMORY_PREFAULT", "false")
os.environ.setdefault("LORASTREAM_STORE_ALLOWED_LOCAL_ROOTS", tempfile.gettempdir())
os.environ.setdefault("LORASTREAM_WORKER_METRICS_PORT", "0")
os.environ.setdefault("LORASTREAM_WORKER_INSECURE_NO_AUTH", "true")
os.environ.setdefault("LORASTREAM_STORE_METRICS_PORT", "0")


def pytest_configure(config: object) -> None:
    """Stop at once if ``lorastream``'s subpackages come from another checkout.

    An editable install points ``lorastream`` at the checkout it was made from; one made from
    another clone would test that clone's code. ``make test`` reinstalls when
    the checkout changes.
    """
    from pathlib import Path

    import lorastream.worker

    here = Path(__file__).resolve().parents[1]
    got = Path(lorastream.worker.__file__).resolve().parents[2]
    if got != here:
        raise SystemExit(
            f"lorastream.worker is imported from {got}, not this checkout ({here}); "
            "run `make install` (or `pip install --no-deps -e .`) here first"
        )
