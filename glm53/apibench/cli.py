"""glm53-bench (python -m glm53.apibench): benchmark any OpenAI-compatible server through
/v1/chat/completions with the suites decode, agent, extend and concurrency; write every sample as
JSON, plots beside it, and print a table per suite.

Exit codes: 0 every suite ran; 1 a suite failed (the JSON keeps the suites measured before it);
2 bad arguments; 3 the server could not be used (nothing at the URL, or /v1/models answered
badly); 130 interrupted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from glm53.apibench.endpoint import api_base
from glm53.apibench.runner import SUITES, run, show
from glm53.apibench.schema import Report, Settings
from glm53.apibench.texts import DECODE_KINDS


def _names(allowed: tuple[str, ...]):
    def parse(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
        names = [v.strip() for v in value.split(",") if v.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise click.BadParameter(f"{value!r}: a comma-separated list of {', '.join(allowed)}")
        return names
    return parse


def _counts(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{value!r}: a comma-separated list of client counts >= 1, e.g. 1,2,4,8,16")
    return counts


def _body(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        body = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise click.BadParameter(f"{value!r}: a JSON object of body fields, e.g. '{{\"cache\": false}}'")
    return body


def _print_schema(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        click.echo(json.dumps(Report.model_json_schema(), indent=1))
        ctx.exit(0)


POSITIVE = click.IntRange(min=1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__)
@click.option("--url", default="http://127.0.0.1:8300", show_default=True,
              help="the server's base URL, with or without /v1")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="sent as a bearer token [env OPENAI_API_KEY]")
@click.option("--model", default=None, help="model id to request (default: the first of GET /v1/models)")
@click.option("--suites", default=",".join(SUITES), show_default=True, callback=_names(tuple(SUITES)))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("api_bench.json"),
              show_default=True, help="the JSON; plots and the tables' text go beside it")
@click.option("--label", default=None, help="what was measured, in words (kept in the JSON and the titles)")
@click.option("--samples", type=POSITIVE, default=6, show_default=True, help="decode: samples per prompt and mode")
@click.option("--decode-tokens", type=POSITIVE, default=320, show_default=True)
@click.option("--decode-kinds", default=",".join(DECODE_KINDS), show_default=True, callback=_names(DECODE_KINDS))
@click.option("--ignore-eos/--no-ignore-eos", default=False, show_default=True,
              help='send "ignore_eos": true so every reply has its full length (where the server takes it)')
@click.option("--agent-turns", type=POSITIVE, default=6, show_default=True)
@click.option("--agent-turn-tokens", type=POSITIVE, default=2700, show_default=True,
              help="new prompt tokens a turn (tool output), sized with the server's tokenizer")
@click.option("--agent-reply-tokens", type=POSITIVE, default=128, show_default=True)
@click.option("--agent-samples", type=POSITIVE, default=3, show_default=True, help="whole conversations")
@click.option("--extend-tokens", type=POSITIVE, default=19000, show_default=True)
@click.option("--extend-reply-tokens", type=POSITIVE, default=8, show_default=True)
@click.option("--extend-samples", type=POSITIVE, default=3, show_default=True)
@click.option("--concurrency", default="1,2,4,8,16", show_default=True, callback=_counts,
              help="client counts, each run at once")
@click.option("--concurrency-tokens", type=POSITIVE, default=128, show_default=True)
@click.option("--concurrency-rounds", type=POSITIVE, default=2, show_default=True)
@click.option("--no-cache-url", default=None,
              help="agent: a second server with its prefix cache off, for the cache-off conversation")
@click.option("--no-cache-body", default=None, callback=_body,
              help="agent: JSON body fields that turn the cache off per request, where the server has such a "
                   "switch (without either option every cache-off request opens with its own first line)")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="seconds per request")
@click.option("--show", "saved", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="print the tables of a saved run's JSON and redraw its plots; contacts no server")
@click.option("--print-schema", is_flag=True, expose_value=False, is_eager=True, callback=_print_schema,
              help="print the JSON schema of the output and exit")
def main(url: str, api_key: str | None, model: str | None, suites: list[str], out: Path, label: str | None,
         samples: int, decode_tokens: int, decode_kinds: list[str], ignore_eos: bool, agent_turns: int,
         agent_turn_tokens: int, agent_reply_tokens: int, agent_samples: int, extend_tokens: int,
         extend_reply_tokens: int, extend_samples: int, concurrency: list[int], concurrency_tokens: int,
         concurrency_rounds: int, no_cache_url: str | None, no_cache_body: dict | None, timeout: float,
         saved: Path | None) -> None:
    if saved is not None:
        sys.exit(show(saved))
    if no_cache_url and no_cache_body is not None:
        raise click.UsageError("--no-cache-url and --no-cache-body are two ways to the same thing: give one")
    for given in [u for u in (url, no_cache_url) if u is not None]:
        try:
            api_base(given)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
    settings = Settings(suites=suites, samples=samples, decode_tokens=decode_tokens, decode_kinds=decode_kinds,
                        ignore_eos=ignore_eos, agent_turns=agent_turns, agent_turn_tokens=agent_turn_tokens,
                        agent_reply_tokens=agent_reply_tokens, agent_samples=agent_samples,
                        extend_tokens=extend_tokens, extend_reply_tokens=extend_reply_tokens,
                        extend_samples=extend_samples, concurrency=concurrency, concurrency_tokens=concurrency_tokens,
                        concurrency_rounds=concurrency_rounds, temperature=0.0, timeout_s=timeout,
                        api_key_given=bool(api_key), no_cache_url=no_cache_url, no_cache_body=no_cache_body)
    sys.exit(run(settings, url, api_key, model, out, label))
