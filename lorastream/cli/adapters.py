"""``lorastream adapters ...``: operator commands against the adapter store."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich import box
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from lorastream.cli.common import Connection, connection_options, out, reported_errors
from lorastream.core.local_paths import absolute_source
from lorastream.core.manifest import AdapterManifest, manifest_json
from lorastream.core.store_client import BytesSink, StoreClient

app = typer.Typer(
    help="Preload, push, list, inspect, pin and delete adapters in the store.",
    rich_markup_mode=None,
    no_args_is_help=True,
)


def _client(conn: Connection) -> StoreClient:
    """The store client every command opens, from its connection options."""
    return StoreClient(conn.target, conn.bearer(), tls=conn.tls())


def _transfer_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), transient=True)


def _staged(verb: str, manifest: AdapterManifest) -> str:
    return (f"[green]{verb}[/] {escape(manifest.name)} ({manifest.adapter_id[:12]}, rank "
            f"{manifest.rank}, {manifest.total_bytes / 1e6:.1f} MB, "
            f"{escape(', '.join(manifest.target_modules))})"
            + (" (pinned)" if manifest.pinned else ""))


@app.command("preload")
@connection_options
def preload(
    uri: str = typer.Argument(
        ..., help="s3://bucket/prefix, hf://org/repo[@revision], file:///abs/path or a local "
        "path (a relative one is taken from the current directory)."
    ),
    name: str = typer.Option(..., "--name", help="Name requests will use for this adapter."),
    pin: bool = typer.Option(False, "--pin", help="Never evict it from the store's cache."),
    force: bool = typer.Option(False, "--force", help="Fetch again even if already staged."),
    *,
    conn: Connection,
) -> None:
    """Fetch, verify and stage an adapter in the store, with a progress bar."""
    with reported_errors(), _client(conn) as client, _transfer_bar() as bar:
        task = bar.add_task(f"{name}: resolving", total=None)
        manifest = None
        for event in client.preload(absolute_source(uri), name, pin=pin, force=force):
            bar.update(
                task,
                description=f"{name}: {event.phase}",
                completed=event.bytes_done,
                total=event.bytes_total or None,
            )
            manifest = event.manifest or manifest
    if manifest is None:
        raise typer.Exit(1)
    out.print(_staged("staged", manifest))


@app.command("push")
@connection_options
def push(
    directory: Path = typer.Argument(
        ..., help="A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors, and "
        "its tokenizer's files if it ships one) on this machine; its files are sent to the "
        "store."
    ),
    name: str = typer.Option(..., "--name", help="Name requests will use for this adapter."),
    pin: bool = typer.Option(False, "--pin", help="Never evict it from the store's cache."),
    force: bool = typer.Option(
        False, "--force", help="Replace a name staged from another source."
    ),
    *,
    conn: Connection,
) -> None:
    """Upload a local adapter to the store (no S3 or shared disk needed), with a progress bar."""
    with reported_errors(), _client(conn) as client, _transfer_bar() as bar:
        task = bar.add_task(f"{name}: uploading", total=None)
        manifest = client.push(
            directory, name, pin=pin, force=force,
            on_sent=lambda done, total: bar.update(task, completed=done, total=total or None),
        )
    out.print(_staged("pushed", manifest))


@app.command("ls")
@connection_options
def ls(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    *,
    conn: Connection,
) -> None:
    """List the adapters staged in the store."""
    with reported_errors(), _client(conn) as client:
        adapters, used, budget = client.list()
    if as_json:
        out.print_json(json.dumps({
            "adapters": [manifest_json(m) for m in adapters],
            "cache_bytes_used": used,
            "cache_bytes_budget": budget,
        }))
        return
    # Names and URIs fold (wrap inside a word) instead of being cut with an ellipsis, so every
    # character stays readable at 80 columns; modules drop their "_proj" suffix (q k v o ...).
    table = Table(title=f"adapters ({used / 1e6:.1f} MB of {budget / 1e9:.1f} GB)",
                  box=box.SIMPLE_HEAD, expand=True)
    table.add_column("name", overflow="fold", ratio=3)
    table.add_column("id", no_wrap=True)
    table.add_column("rank", justify="right", no_wrap=True)
    table.add_column("alpha", justify="right", no_wrap=True)
    table.add_column("modules", overflow="fold", ratio=2, min_width=6)
    table.add_column("MB", justify="right", no_wrap=True)
    table.add_column("pin", no_wrap=True)
    table.add_column("source", overflow="fold", ratio=4)
    for m in adapters:
        table.add_row(
            m.name, m.adapter_id[:8], str(m.rank), f"{m.alpha:g}",
            " ".join(t.removesuffix("_proj") for t in m.target_modules),
            f"{m.total_bytes / 1e6:.1f}", "yes" if m.pinned else "", m.source_uri,
        )
    out.print(table)


@app.command("describe")
@connection_options
def describe(
    name: str,
    *,
    conn: Connection,
) -> None:
    """Print an adapter's manifest as JSON."""
    with reported_errors(), _client(conn) as client:
        manifest = client.describe(name)
    out.print_json(json.dumps(manifest_json(manifest, tensors=True)))


@app.command("rm")
@connection_options
def rm(
    name: str,
    *,
    conn: Connection,
) -> None:
    """Delete an adapter from the store."""
    with reported_errors(), _client(conn) as client:
        client.delete(name)
    out.print(f"deleted {name}", markup=False)


@app.command("pin")
@connection_options
def pin(
    name: str,
    *,
    conn: Connection,
) -> None:
    """Protect an adapter from cache eviction."""
    with reported_errors(), _client(conn) as client:
        client.pin(name)
    out.print(f"pinned {name}", markup=False)


@app.command("unpin")
@connection_options
def unpin(
    name: str,
    *,
    conn: Connection,
) -> None:
    """Let an adapter be evicted again."""
    with reported_errors(), _client(conn) as client:
        client.unpin(name)
    out.print(f"unpinned {name}", markup=False)


@app.command("history")
@connection_options
def history(
    name: str,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    *,
    conn: Connection,
) -> None:
    """List a name's versions, newest first (request one as NAME@<id prefix>)."""
    with reported_errors(), _client(conn) as client:
        versions = client.history(name)
    if as_json:
        out.print_json(json.dumps([dataclasses.asdict(v) for v in versions]))
        return
    table = Table(title=f"versions of {name}", box=box.SIMPLE_HEAD, expand=True)
    table.add_column("version", no_wrap=True)
    table.add_column("id", no_wrap=True)
    table.add_column("registered (UTC)", no_wrap=True)
    table.add_column("MB", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("source", overflow="fold", ratio=1)
    for v in versions:
        when = datetime.fromtimestamp(v.created_at, UTC).strftime("%Y-%m-%d %H:%M:%S")
        state = "current" if v.current else ("staged" if v.staged else "evicted")
        table.add_row(f"v{v.version}", v.adapter_id[:12], when,
                      f"{v.total_bytes / 1e6:.1f}" if v.staged else "", state, v.source_uri)
    out.print(table)


@app.command("rollback")
@connection_options
def rollback(
    name: str,
    version: str = typer.Argument(
        "", help="vN (from 'adapters history') or the start of a content id; omitted: the "
        "content the name pointed at before its current one."
    ),
    *,
    conn: Connection,
) -> None:
    """Point a name at one of its earlier versions again (recorded as its newest version)."""
    with reported_errors(), _client(conn) as client:
        manifest = client.rollback(name, version)
    out.print(_staged("rolled back", manifest))


@app.command("pull")
@connection_options
def pull(
    name: str,
    out_dir: Path = typer.Option(..., "--out", help="Directory to write the PEFT adapter into."),
    *,
    conn: Connection,
) -> None:
    """Stream an adapter from the store and write it as a PEFT directory."""
    from lorastream.core.peft_writer import write_peft_dir

    with reported_errors(), _client(conn) as client:
        sink = BytesSink()
        manifest = client.stream_tensors(name, sink)
    write_peft_dir(manifest, sink.buffers, out_dir)
    out.print(f"wrote {name} ({manifest.total_bytes / 1e6:.1f} MB) to {out_dir}", markup=False)
