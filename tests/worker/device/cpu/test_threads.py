"""The engine's thread keeps its intra-op threads while request and loader threads take one each:
a side thread's setting must not reach the engine's thread through torch's
process-wide count, which a C++ extension's first parallel op adopts on the engine's thread.

Each case runs in a fresh interpreter: torch's adoption of the count is per thread and per shared
object, once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lorastream.kernels.cpu import ops as cpu_ops

PROBE = """
import json, threading, torch
from lorastream.kernels.cpu import norm_rope as cpu_norm_rope
from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.worker.device.cpu import threads
assert cpu_ops.load() is None
threads.use_intra_op_threads(2)  # the engine's thread
seen = {}
def side():
    getattr(threads, SIDE)(*ARGS)
    seen["side"] = torch.get_num_threads()
t = threading.Thread(target=side)
t.start()
t.join()
cpu_norm_rope.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-5)  # the extension's first op here
seen["engine"] = torch.get_num_threads()
print(json.dumps(seen))
"""


def _probe(side: str, args: tuple[object, ...]) -> dict[str, int]:
    code = f"SIDE = {side!r}\nARGS = {args!r}\n" + PROBE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def native_ops() -> None:
    error = cpu_ops.load()
    if error is not None:
        pytest.skip(f"the C++ CPU ops did not build here: {error}")


@pytest.mark.parametrize("side, args", [
    ("use_one_intra_op_thread", ()),
    ("loader_thread_init", ("nice:0",)),
])
def test_a_side_thread_takes_one_thread_and_the_engine_keeps_two(
    native_ops: None, side: str, args: tuple[object, ...]
) -> None:
    seen = _probe(side, args)
    assert seen == {"side": 1, "engine": 2}


def test_torch_set_num_threads_on_a_side_thread_takes_the_engines_threads(native_ops: None) -> None:
    """Why the side threads do not call torch.set_num_threads(1): shown, so that the test above
    keeps meaning something if torch changes (then this one fails, and the workaround can go)."""
    seen = _probe("use_intra_op_threads", (1,))
    assert seen == {"side": 1, "engine": 1}
