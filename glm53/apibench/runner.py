"""A run: probe the server(s), then each suite in turn; the JSON is rewritten atomically after each
suite (and its plot written beside it), so a run that fails half-way keeps what it measured; the
tables come last, on stdout and in a .txt beside the JSON."""
from __future__ import annotations

import datetime
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from glm53.apibench.context import RunContext
from glm53.apibench.endpoint import BenchError, Endpoint
from glm53.apibench.progress import Display
from glm53.apibench.schema import Failure, Report, ServerInfo, Settings, Suites
from glm53.apibench.suites import agent, concurrency, decode, extend
from glm53.apibench.tables import print_tables
from glm53.measurement import device_description, git_commit, versions, write_json

SUITES: dict[str, Callable[[RunContext], Any]] = {"decode": decode.run, "agent": agent.run, "extend": extend.run,
                                                   "concurrency": concurrency.run}
PLOTTED = ("agent", "concurrency")
EXIT_OK, EXIT_SUITE_FAILED, EXIT_NO_SERVER, EXIT_INTERRUPTED = 0, 1, 3, 130
CLIENT_PACKAGES = ("openai", "httpx", "pydantic", "rich", "matplotlib")


def side_file(out: Path, suffix: str) -> Path:
    """A file beside the JSON: api_bench.json -> api_bench_agent.png, api_bench.txt."""
    return out.with_name(out.stem + suffix)


def probe(url: str, api_key: str | None, model: str | None, timeout: float) -> tuple[Endpoint, ServerInfo]:
    endpoint = Endpoint(url, api_key, model, timeout)
    return endpoint, endpoint.describe()


def new_report(settings: Settings, label: str | None, server: ServerInfo, no_cache: ServerInfo | None) -> Report:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Report(label=label, git_commit=git_commit(), client_device=device_description("cpu"),
                  cpu_cores=os.cpu_count(), versions=versions(CLIENT_PACKAGES), run_id=secrets.token_hex(4),
                  started_at=now, settings=settings, server=server, no_cache_server=no_cache, suites=Suites(),
                  plots={}, failure=None, complete=False)


def emit_tables(report: Report, out: Path) -> None:
    """The tables on stdout and, as text, in the .txt beside the JSON (off a terminal 120 columns
    wide, so logs keep whole rows)."""
    console = Console(record=True, width=None if sys.stdout.isatty() else 120)
    print_tables(report, console)
    console.save_text(str(side_file(out, ".txt")))


def save(report: Report, out: Path) -> None:
    write_json(out, report.model_dump(mode="json"))


def plot(name: str, report: Report, out: Path) -> Path:
    from glm53.apibench import plots  # matplotlib takes about a second to import: only when a plot is made

    make = {"agent": plots.plot_agent, "concurrency": plots.plot_concurrency}[name]
    title = f"{name}: {report.server.model}" + (f" ({report.label})" if report.label else "")
    return make(getattr(report.suites, name), side_file(out, f"_{name}.png"), title)


def show(saved: Path) -> int:
    """Print the tables of a saved run and redraw its plots beside it; no server is contacted."""
    report = Report.model_validate_json(saved.read_text())
    for name in PLOTTED:
        if getattr(report.suites, name) is not None:
            report.plots[name] = plot(name, report, saved).name
    save(report, saved)
    emit_tables(report, saved)
    return EXIT_OK


def run(settings: Settings, url: str, api_key: str | None, model: str | None, out: Path, label: str | None) -> int:
    display = Display()
    try:
        endpoint, server = probe(url, api_key, model, settings.timeout_s)
        no_cache_endpoint, no_cache = (probe(settings.no_cache_url, api_key, None, settings.timeout_s)
                                       if settings.no_cache_url else (None, None))
    except BenchError as exc:
        display.say(f"glm53-bench: {exc}")
        return EXIT_NO_SERVER
    report = new_report(settings, label, server, no_cache)
    save(report, out)
    ctx = RunContext(endpoint=endpoint, server=server, settings=settings, run_id=report.run_id, display=display,
                     no_cache=no_cache_endpoint)
    display.say(f"glm53-bench: {server.model} at {server.base_url}; suites {', '.join(settings.suites)}; "
                f"JSON {out}")
    code = EXIT_OK
    with display:
        for name in settings.suites:
            try:
                setattr(report.suites, name, SUITES[name](ctx))
            except BenchError as exc:
                report.failure, code = Failure(suite=name, error=str(exc)), EXIT_SUITE_FAILED
            except KeyboardInterrupt:
                report.failure, code = Failure(suite=name, error="interrupted"), EXIT_INTERRUPTED
            if code != EXIT_OK:
                break
            if name in PLOTTED:
                report.plots[name] = plot(name, report, out).name
            save(report, out)
    report.complete = code == EXIT_OK
    save(report, out)
    emit_tables(report, out)
    if report.failure is not None:
        display.say(f"glm53-bench: suite {report.failure.suite} failed: {report.failure.error}\n"
                    f"glm53-bench: {out} keeps the suites measured before it "
                    f"({', '.join(n for n in settings.suites if getattr(report.suites, n) is not None) or 'none'})")
    return code
