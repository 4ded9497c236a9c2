"""The tables a run prints last, one per suite measured: medians with [min-max] where samples vary."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from glm53.apibench.schema import AgentSuite, ConcurrencySuite, DecodeSuite, ExtendSuite, Report, Summary


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"


def _med(s: Summary | None, digits: int = 3, ranged: bool = True) -> str:
    if s is None:
        return "-"
    if not ranged or s.min == s.max:
        return _num(s.median, digits)
    return f"{_num(s.median, digits)} [{_num(s.min, digits)}-{_num(s.max, digits)}]"


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="left" if c in ("kind", "mode", "leg") else "right")
    return table


def decode_table(suite: DecodeSuite) -> Table:
    d = suite.draft_field
    table = _table(f'decode ("draft": false {"accepted" if d.accepted else "refused"}; server drafting: '
                   f'{"unknown" if d.server_drafting is None else d.server_drafting})',
                   "kind", "mode", "n", "tokens", "TTFT s", "decode tok/s", "spread %")
    for c in suite.cases:
        spread = c.decode_tok_s.spread_pct if c.decode_tok_s else None
        table.add_row(c.kind, c.mode, str(c.completion_tokens.n), _med(c.completion_tokens, ranged=False),
                      _med(c.ttft_s), _med(c.decode_tok_s), _num(spread, 2))
    return table


def agent_table(suite: AgentSuite) -> Table:
    table = _table(f"agent (cache off by {suite.cache_off.mode}; last/first turn with cache: "
                   f"{_num(suite.last_over_first_on)})",
                   "turn", "prompt", "new", "cached on", "cached off", "wall on s", "wall off s", "speedup")
    for t in suite.turns:
        table.add_row(str(t.turn), _med(t.prompt_tokens, 6, False), _med(t.new_prompt_tokens, 6, False),
                      _med(t.cached_on, 6, False), _med(t.cached_off, 6, False), _med(t.wall_on_s),
                      _med(t.wall_off_s), _num(t.speedup))
    return table


def extend_table(suite: ExtendSuite) -> Table:
    table = _table(f"extend (cold / extended: TTFT {_num(suite.ttft_speedup)}x, wall {_num(suite.wall_speedup)}x)",
                   "leg", "prompt", "cached", "TTFT s", "wall s")
    for name, leg in (("cold", suite.cold), ("extended", suite.extended)):
        table.add_row(name, _med(leg.prompt_tokens, 6, False), _med(leg.cached_tokens, 6, False), _med(leg.ttft_s),
                      _med(leg.wall_s))
    return table


def concurrency_table(suite: ConcurrencySuite) -> Table:
    table = _table("concurrency", "clients", "aggregate tok/s", "per-stream tok/s", "TTFT p50 s", "TTFT p99 s")
    for level in suite.levels:
        ttft = level.ttft_s
        table.add_row(str(level.clients), _med(level.aggregate_tok_s), _med(level.per_stream_tok_s),
                      _num(ttft.p50 if ttft else None), _num(ttft.p99 if ttft else None))
    return table


def print_tables(report: Report, console: Console) -> None:
    server = report.server
    console.print(f"{report.label or 'API benchmark'}: {server.model} at {server.base_url} "
                  f"(commit {report.git_commit})", highlight=False)
    makers = {"decode": decode_table, "agent": agent_table, "extend": extend_table, "concurrency": concurrency_table}
    for name, make in makers.items():
        suite = getattr(report.suites, name)
        if suite is not None:
            console.print(make(suite))
