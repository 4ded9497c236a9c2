"""The JSON a run writes (`Report`): what ran, against which server, with which settings, and every
sample with its summaries. `glm53-bench --print-schema` prints it as a JSON schema. Times are
seconds, rates tokens per second; token counts come from the server's `usage`."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Summary(Strict):
    """Over the samples: median (p50), min, max, n, and spread = (max - min) / median in percent."""
    median: float
    min: float
    max: float
    n: int
    spread_pct: float | None


class Latency(Summary):
    p50: float
    p99: float  # nearest rank: the largest sample while n <= 100


class RequestTiming(Strict):
    """One streamed request. ttft: from sending to the first chunk with content; decode_tok_s =
    (completion_tokens - 1) / (last content chunk - first content chunk), None below 2 tokens."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    ttft_s: float | None
    wall_s: float
    decode_tok_s: float | None
    finish_reason: str | None


class ServerInfo(Strict):
    base_url: str
    model: str
    models: list[dict[str, Any]] | None  # GET /v1/models' entries as served
    models_error: str | None  # why /v1/models could not be read (the model was given)
    health: dict[str, Any] | None  # GET /health as served; None: no such route
    context: int | None  # tokens per request, where the API says (max_model_len or /health's context)
    drafting: bool | None  # /health's "drafting", where it says
    prefix_cache: str | None  # /health's "prefix_cache", where it says


class Settings(Strict):
    suites: list[str]
    samples: int
    decode_tokens: int
    decode_kinds: list[str]
    ignore_eos: bool
    agent_turns: int
    agent_turn_tokens: int
    agent_reply_tokens: int
    agent_samples: int
    extend_tokens: int
    extend_reply_tokens: int
    extend_samples: int
    concurrency: list[int]
    concurrency_tokens: int
    concurrency_rounds: int
    temperature: float
    timeout_s: float
    api_key_given: bool
    no_cache_url: str | None
    no_cache_body: dict[str, Any] | None


# ---- decode ------------------------------------------------------------------------------------
class DraftField(Strict):
    """`"draft": false` sent as an extra body field: whether the server took it (HTTP 200) or refused
    it (the error), and whether /health says the server drafts at all."""
    accepted: bool
    error: str | None
    server_drafting: bool | None


class DecodeSample(RequestTiming):
    kind: str
    mode: Literal["default", "draft_false"]
    sample: int


class DecodeCase(Strict):
    kind: str
    mode: Literal["default", "draft_false"]
    ttft_s: Summary | None
    decode_tok_s: Summary | None
    completion_tokens: Summary


class DecodeSuite(Strict):
    draft_field: DraftField
    warmup_requests: int  # discarded requests: the run's warm-up when this suite came first, the draft probe
    cases: list[DecodeCase]
    default_over_draft_false: dict[str, float | None]  # per kind: ratio of the decode tok/s medians
    samples: list[DecodeSample]


# ---- agent -------------------------------------------------------------------------------------
class CacheOff(Strict):
    """How the cache-off conversation avoided reuse: "url" a second server with its cache off,
    "body" a per-request switch sent as extra body fields, "salt" a unique first line in every
    request's system prompt (no prefix but the template's first tokens can match)."""
    mode: Literal["url", "body", "salt"]
    url: str | None
    body: dict[str, Any] | None


class AgentRequest(RequestTiming):
    sample: int
    turn: int
    cache: Literal["on", "off"]


class AgentTurnRow(Strict):
    turn: int
    prompt_tokens: Summary
    new_prompt_tokens: Summary  # prompt tokens beyond the previous turn's prompt (its reply included)
    cached_on: Summary | None
    cached_off: Summary | None
    wall_on_s: Summary
    wall_off_s: Summary
    ttft_on_s: Summary | None
    ttft_off_s: Summary | None
    speedup: float | None  # wall off / wall on, medians
    ttft_speedup: float | None


class AgentSuite(Strict):
    cache_off: CacheOff
    chars_per_token: float  # measured on the server's tokenizer, to size each turn's tool output
    warmup_requests: int  # 1 when this suite came first in the run (its warm-up request), else 0
    turns: list[AgentTurnRow]
    last_over_first_on: float | None  # the last turn's wall over the first's, cache on
    requests: list[AgentRequest]


# ---- extend ------------------------------------------------------------------------------------
class ExtendRequest(RequestTiming):
    sample: int
    leg: Literal["cold", "extended"]


class ExtendLeg(Strict):
    prompt_tokens: Summary
    cached_tokens: Summary | None
    ttft_s: Summary | None
    wall_s: Summary


class ExtendSuite(Strict):
    chars_per_token: float
    warmup_requests: int
    cold: ExtendLeg
    extended: ExtendLeg
    ttft_speedup: float | None  # cold over extended, medians
    wall_speedup: float | None
    requests: list[ExtendRequest]


# ---- concurrency -------------------------------------------------------------------------------
class Stream(RequestTiming):
    clients: int
    round: int
    client: int
    start_s: float  # from the round's start
    end_s: float


class Level(Strict):
    clients: int
    aggregate_tok_s: Summary  # per round: all streams' completion tokens over the round's wall time
    per_stream_tok_s: Summary | None  # each stream's decode tok/s
    ttft_s: Latency | None


class ConcurrencySuite(Strict):
    warmup_requests: int
    levels: list[Level]
    streams: list[Stream]


class Suites(Strict):
    decode: DecodeSuite | None = None
    agent: AgentSuite | None = None
    extend: ExtendSuite | None = None
    concurrency: ConcurrencySuite | None = None


class Failure(Strict):
    suite: str
    error: str


class Report(Strict):
    bench: Literal["api_bench"] = "api_bench"
    schema_version: Literal[1] = 1
    label: str | None
    git_commit: str  # the kit's commit (glm53.measurement.git_commit)
    client_device: str  # where the client ran; the server's device is what `server` says
    cpu_cores: int | None
    versions: dict[str, str]
    run_id: str  # in the first line of the agent, extend and concurrency prompts: no run reuses another's cache
    started_at: str
    settings: Settings
    server: ServerInfo
    no_cache_server: ServerInfo | None
    suites: Suites
    plots: dict[str, str]  # suite -> PNG file name beside the JSON
    failure: Failure | None
    complete: bool
