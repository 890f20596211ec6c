"""PNG plots of benchmark results (matplotlib, Agg backend, about 900x600 pixels).

Each function takes one benchmark's result JSON (as a dict), draws what it holds and returns the
path written, or None when the result lacks the data for that plot (e.g. no raw samples)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator

from benchpage.report_format import as_number, get

_SIZE = (9.0, 6.0)  # inches at 100 dpi: 900 x 600 pixels
_DPI = 100
_MODES = (("overlap_on", "overlap on", "tab:blue"), ("overlap_off", "overlap off", "tab:orange"))


def ttft_itl_cdf(serve: Mapping[str, Any], out_png: Path) -> Path | None:
    """TTFT and ITL CDFs of the serve trace, overlapped loading on vs off (two panels)."""
    series = {
        key: {mode: _floats(get(serve, mode, "trace", "samples", key)) for mode, _, _ in _MODES}
        for key in ("ttft_ms", "itl_ms")
    }
    if not any(values for per_mode in series.values() for values in per_mode.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=_SIZE, dpi=_DPI)
    for ax, key, label in zip(axes, ("ttft_ms", "itl_ms"), ("TTFT", "inter-token latency"),
                              strict=True):
        for mode, name, color in _MODES:
            _cdf(ax, series[key][mode], f"{name} ({_p50_label(series[key][mode])})", color)
        _cdf_axes(ax, f"{label} (ms)", f"{label} CDF", [*series[key].values()])
    fig.suptitle("Serving trace: cold adapters, overlapped loading on vs off\n"
                 + _serve_config(serve))
    return _save(fig, out_png)


def interference_cdf(serve: Mapping[str, Any], out_png: Path) -> Path | None:
    """ITL CDF of running streams with no loads and during adapter loads, per overlap mode."""
    fig, ax = plt.subplots(figsize=_SIZE, dpi=_DPI)
    drawn: list[list[float]] = []
    for mode, name, color in _MODES:
        samples = get(serve, mode, "interference", "samples") or {}
        for key, when, style in (("itl_ms_no_loads", "no loads", ":"),
                                 ("itl_ms_during_loads", "during loads", "-")):
            values = _floats(samples.get(key))
            if values:
                _cdf(ax, values, f"{name}, {when}", color, style)
                drawn.append(values)
    if not drawn:
        plt.close(fig)
        return None
    _cdf_axes(ax, "inter-token latency of running base-model streams (ms)", "", drawn)
    streams = get(serve, "overlap_on", "interference", "background_streams")
    fig.suptitle(
        "Decode interference: running streams while adapters load\n"
        + _serve_config(serve) + (f", {streams} background streams" if streams else "")
    )
    return _save(fig, out_png)


_SHARE_COLORS = ("tab:green", "tab:purple", "tab:red", "tab:brown")


def cold_ttft_cdf(serve: Mapping[str, Any], out_png: Path) -> Path | None:
    """Cold requests' TTFT CDFs of the burst and the link-limited workloads, per mode."""
    panels = (("cold_burst", "burst: cold adapters beside resident ones"),
              ("cold_link", "link-limited store: one cold adapter at a time"))
    drawn = [key for key, _ in panels if isinstance(serve.get(key), Mapping)]
    if not drawn:
        return None
    fig, axes = plt.subplots(1, len(drawn), figsize=_SIZE, dpi=_DPI, squeeze=False)
    for ax, (key, title) in zip(axes[0], [p for p in panels if p[0] in drawn], strict=True):
        shares = [k for k in serve[key] if k.startswith("overlap_on_share_")]
        cold_modes = [("overlap_on", "overlap on", "tab:blue"),
                      *((k, f"on, --load-share {k.removeprefix('overlap_on_share_')}",
                         _SHARE_COLORS[i % len(_SHARE_COLORS)]) for i, k in enumerate(shares)),
                      ("overlap_off", "overlap off", "tab:orange")]
        series = []
        for mode, name, color in cold_modes:
            values = _floats(get(serve, key, mode, "samples", "cold_ttft_ms"))
            _cdf(ax, values, f"{name} ({_p50_label(values)})", color)
            series.append(values)
        _cdf_axes(ax, "cold request's TTFT (ms)", title, series)
    fig.suptitle("Cold adapters on a busy CPU worker: TTFT of the cold requests\n"
                 + _serve_config(serve))
    return _save(fig, out_png)


def scale_plot(scale: Mapping[str, Any], out_png: Path) -> Path | None:
    """Throughput and TTFT p50/p99 against the number of adapters (log x); PEFT as reference."""
    runs = [r for r in scale.get("runs") or [] if as_number(r.get("adapters")) is not None]
    runs.sort(key=lambda r: r["adapters"])
    if not runs:
        return None
    counts = [r["adapters"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=_SIZE, dpi=_DPI)
    _line(left, counts, [r.get("throughput_req_s") for r in runs], "lorastream", "tab:blue", "o")
    peft = scale.get("peft") or {}
    peft_rate = as_number(peft.get("throughput_req_s"))
    if peft_rate is not None:
        left.axhline(peft_rate, color="tab:red", linestyle="--",
                     label=f"HF + PEFT ({peft.get('adapters', max(counts))} adapters)")
    left.set_ylim(bottom=0)
    left.set_ylabel("throughput (requests/s)")
    left.set_title("Throughput")
    for key, style in (("p50", "o-"), ("p99", "s--")):
        values = [get(r, "ttft_ms", key) for r in runs]
        _line(right, counts, values, f"TTFT {key}", "tab:green", style[0], style[1:])
    right.set_ylim(bottom=0)
    right.set_ylabel("time to first token (ms)")
    right.set_title("TTFT")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(counts))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(c) for c in counts])
        ax.set_xlabel("adapters in the store")
        ax.grid(True, alpha=0.3)
        ax.legend()
    config = scale.get("config") or {}
    fig.suptitle(
        f"Scale: one workload over more adapters — model {config.get('model', '?')}, "
        f"{config.get('popularity', '?')}, {config.get('requests', '?')} requests, "
        f"{config.get('slots', '?')} slots"
    )
    return _save(fig, out_png)


def transfer_plot(transfer: Mapping[str, Any], out_png: Path) -> Path | None:
    """MB/s against chunk size (log2 x) for the bare gRPC stream, the store and verified (one
    line per tensor digest when the result has them)."""
    points = [p for p in transfer.get("points") or [] if as_number(p.get("chunk_bytes"))]
    points.sort(key=lambda p: p["chunk_bytes"])
    if not points:
        return None
    sizes = [p["chunk_bytes"] for p in points]
    fig, ax = plt.subplots(figsize=_SIZE, dpi=_DPI)
    for key, label, color, marker in (
        ("bare_mb_s", "bare gRPC (raw bytes)", "tab:gray", "o"),
        *((("bare_kept_mb_s", "bare gRPC, freed buffers kept", "black", "x"),)
          if any("bare_kept_mb_s" in p for p in points) else ()),
        ("store_mb_s", "store stream (CRC-32C checked)", "tab:blue", "s"),
        *((("verified_sha256_mb_s", "landed + sha256", "tab:red", "v"),
           ("verified_blake3_mb_s", "landed + BLAKE3", "tab:orange", "D"),
           ("verified_xxh3_mb_s", "landed + xxh3-128 (default)", "tab:green", "^"))
          if any("verified_xxh3_mb_s" in p for p in points)
          else (("verified_mb_s", "store, landed + sha256 verified", "tab:green", "^"),)),
    ):
        _line(ax, sizes, [p.get(key) for p in points], label, color, marker)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([format_bytes(s) for s in sizes])
    ax.set_xlabel("chunk size")
    ax.set_ylabel("rate (MB/s, median of rounds)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    mb = as_number(transfer.get("adapter_bytes"))
    size = f"{mb / 1e6:.0f} MB adapter" if mb else "synthetic adapter"
    fig.suptitle(f"Adapter stream on loopback: {size}, {transfer.get('repeats', '?')} rounds "
                 "per chunk size")
    return _save(fig, out_png)


def soak_rss(soak: Mapping[str, Any], out_png: Path) -> Path | None:
    """Each worker's RSS over the soak, with its phases marked (warm-up end, restart, end)."""
    timelines = get(soak, "rss", "timeline_mb") or []
    series = [[[as_number(v) for v in p] for p in worker if isinstance(p, Sequence) and len(p) >= 2]
              for worker in timelines]
    if not any(series):
        return None
    fig, ax = plt.subplots(figsize=_SIZE, dpi=_DPI)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for i, points in enumerate(series):
        color = colors[i % len(colors)]
        for column, label, style in ((1, f"worker {i}, RSS", "-"),
                                     (2, f"worker {i}, anonymous (heap)", ":")):
            pairs = [(p[0], p[column]) for p in points
                     if len(p) > column and p[0] is not None and p[column] is not None]
            if pairs:
                ax.plot(*zip(*pairs, strict=True), label=label, color=color, linestyle=style,
                        linewidth=1)
    marks = get(soak, "rss", "marks_s") or {}
    for key, label, style in (("warm_up_end", "warm-up end", ":"), ("restart", "restart", "--"),
                              ("soak_end", "soak end", "-.")):
        at = as_number(marks.get(key))
        if at is not None:
            ax.axvline(at, color="gray", linestyle=style, label=label)
    ax.set_xlabel("time since the workers started (s)")
    ax.set_ylabel("resident memory (MB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    c = soak.get("config") or {}
    fig.suptitle(f"Soak: worker RSS each second — {c.get('workers', '?')} workers, "
                 f"{c.get('adapters', '?')} adapters, {c.get('load_factor', '?')}x capacity")
    return _save(fig, out_png)


def soak_latency(soak: Mapping[str, Any], out_png: Path) -> Path | None:
    """TTFT and end-to-end latency CDFs of the soak's requests."""
    series = {key: _floats(get(soak, "latency", "cdf", key)) for key in ("ttft_ms", "e2e_ms")}
    if not any(series.values()):
        return None
    fig, ax = plt.subplots(figsize=_SIZE, dpi=_DPI)
    for key, label, color in (("ttft_ms", "TTFT", "tab:blue"),
                              ("e2e_ms", "end-to-end", "tab:orange")):
        _cdf(ax, series[key], label, color)
    _cdf_axes(ax, "latency (ms)", "", list(series.values()))
    soak_rate = get(soak, "soak", "rate_req_s")
    fig.suptitle(f"Soak: latency CDF at {soak_rate} req/s (TTFT includes queueing)")
    return _save(fig, out_png)


def format_bytes(n: float) -> str:
    """65536 -> '64K', 1048576 -> '1M' (binary units, as the CLI takes them)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    return str(int(n))


# -- helpers ---------------------------------------------------------------------------------
def _floats(values: object) -> list[float]:
    if not isinstance(values, Sequence):
        return []
    return [v for v in (as_number(x) for x in values) if v is not None]


def _cdf(ax: Axes, values: list[float], label: str, color: str, style: str = "-") -> None:
    if not values:
        return
    ordered = sorted(values)
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    ax.step(ordered, fractions, where="post", label=label, color=color, linestyle=style)


def _cdf_axes(ax: Axes, xlabel: str, title: str, series: Sequence[list[float]]) -> None:
    """Label a CDF panel; a log x axis when the samples span more than 1.5 decades (tails)."""
    values = [v for s in series for v in s if v > 0]
    if values and max(values) / min(values) > 10**1.5:
        ax.set_xscale("log")
        xlabel += ", log scale"
    else:
        ax.set_xlim(left=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    ax.legend(loc="lower right")


def _p50_label(values: list[float]) -> str:
    if not values:
        return "no samples"
    return f"p50 {sorted(values)[len(values) // 2]:.1f} ms, n={len(values)}"


def _line(ax: Axes, xs: Sequence[float], ys: Sequence[object], label: str, color: str,
          marker: str, style: str = "-") -> None:
    pairs = [(x, y) for x, y in zip(xs, (as_number(v) for v in ys), strict=True) if y is not None]
    if pairs:
        ax.plot(*zip(*pairs, strict=True), marker=marker, linestyle=style, color=color, label=label)


def _serve_config(serve: Mapping[str, Any]) -> str:
    c = serve.get("config") or {}
    return (f"model {c.get('model', '?')}, {c.get('adapters', '?')} adapters of rank "
            f"{c.get('rank', '?')}, {c.get('slots', '?')} slots, {c.get('popularity', '?')}, "
            f"{c.get('rate', '?')} req/s")


def _save(fig: Figure, out_png: Path) -> Path:
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_png, format="png")
    plt.close(fig)
    return out_png
