"""Fixtures for the S3 and Hub source tests: real servers on loopback and real PEFT adapters.

The servers are session-scoped (each test uses its own bucket or repo). The environment fixtures
keep the tests away from the machine's ~/.aws and ~/.cache/huggingface.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorastream.bench.synthetic import BaseShape, make_synthetic_adapter
from lorastream.store.sources import SourceRegistry
from lorastream.store.sources.local import LocalSource
from lorastream.store.store import AdapterStore
from tests.store.fixtures_core import StoreFactory
from tests.support.hub_server import HubServer
from tests.support.models import (
    ALL_LINEAR,
    ALORA_INVOCATION,
    ATTENTION,
    MLP,
    make_peft_adapter,
    make_tiny_llama,
    save_adapter_tokenizer,
    save_tiny_tokenizer,
)
from tests.support.s3_server import DUMMY_CREDENTIALS, MotoS3Server

# 6 layers x rank 64 x 4096 features x 4 bytes = 6 MiB of weights: above S3's 5 MiB part size.
SIX_MIB_SHAPE = BaseShape(
    hidden=256, intermediate=512, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64
)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy AWS credentials; no profile, config file or endpoint from the machine."""
    for name, value in DUMMY_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config-absent"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials-absent"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """HF_HOME under tmp_path, no token or endpoint from the machine."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    """moto's S3 server on 127.0.0.1, port 0, for the whole session."""
    server = MotoS3Server().start()
    yield server
    server.stop()


@pytest.fixture
def bucket(moto_s3: MotoS3Server) -> str:
    """A fresh, empty bucket on the moto server."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    moto_s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def hub_server() -> Iterator[HubServer]:
    """The test Hub on 127.0.0.1, port 0, for the whole session."""
    with HubServer() as hub:
        yield hub


@pytest.fixture(scope="session")
def peft_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real PEFT adapters on a tiny random Llama ("r4", "r8"), a 6 MiB synthetic one, and
    "tokenizer": r4 saved beside its own tokenizer (reserved id 200 renamed to the added token
    <tool>, its end of turn in a generation config)."""
    root = tmp_path_factory.mktemp("source-adapters")
    base = make_tiny_llama(root / "base")
    dirs = {
        "r4": make_peft_adapter(base, root / "r4", rank=4, targets=["q_proj", "v_proj"]),
        "r8": make_peft_adapter(base, root / "r8", rank=8, seed=2),
        "six-mib": make_synthetic_adapter(root / "six-mib", SIX_MIB_SHAPE, rank=64),
    }
    tokenizer = root / "tokenizer"
    shutil.copytree(dirs["r4"], tokenizer)
    save_adapter_tokenizer(save_tiny_tokenizer(root / "base-tokenizer"), tokenizer, {200: "<tool>"})
    (tokenizer / "generation_config.json").write_text('{"eos_token_id": [2, 200]}')
    return {**dirs, "tokenizer": tokenizer}


# -- the store core tests: real PEFT adapters, stores on local files ------------------------------


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real PEFT adapters on a tiny random Llama: attention r4, all-linear r8, MLP r16 rsLoRA,
    attention r4 DoRA, attention r4 activated LoRA (invoked by ``ALORA_INVOCATION``)."""
    root = tmp_path_factory.mktemp("core-adapters")
    base = make_tiny_llama(root / "base")
    return {
        "attn-r4": make_peft_adapter(base, root / "attn-r4", rank=4, targets=ATTENTION),
        "all-r8": make_peft_adapter(base, root / "all-r8", rank=8, targets=ALL_LINEAR, seed=2),
        "mlp-r16": make_peft_adapter(
            base, root / "mlp-r16", rank=16, targets=MLP, use_rslora=True, seed=3
        ),
        "dora-attn-r4": make_peft_adapter(
            base, root / "dora-attn-r4", rank=4, targets=ATTENTION, use_dora=True, seed=4
        ),
        "alora-attn-r4": make_peft_adapter(
            base, root / "alora-attn-r4", rank=4, targets=ATTENTION, seed=5,
            alora_invocation_tokens=ALORA_INVOCATION,
        ),
    }


@pytest.fixture
def store_factory(tmp_path: Path) -> StoreFactory:
    """Build AdapterStores on ``tmp_path/cache`` (the same dir each call, to test restarts)."""

    def make(
        cache_bytes: int = 1 << 30,
        *,
        source: LocalSource | None = None,
        cache_dir: Path | None = None,
        max_header_bytes: int = 16 << 20,
    ) -> AdapterStore:
        return AdapterStore(
            cache_dir or tmp_path / "cache",
            cache_bytes,
            SourceRegistry([source or LocalSource()]),
            max_header_bytes=max_header_bytes,
        )

    return make
