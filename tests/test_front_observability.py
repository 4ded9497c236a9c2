"""The front's observability over the REAL glm53 engine on the tiny checkpoint, through a real
front server on loopback: the per-request log line, the prefix cache's counters and the drafter's
acceptance counters in /metrics, and /metrics as strict Prometheus text.

One engine (the session's tiny_engine) with a real kv_cache.PrefixCache and a copy-draft
DraftPlan attached for this module, restored afterwards.
"""
from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from drafter.glm53_target import DraftPlan
from glm53.serving.front import observe
from glm53.serving.front.chat import ChatText
from glm53.serving.rank import glm53_sampling
from glm53.serving.front.server import serve
from glm53.serving.front.service import Service
from glm53.serving.front.settings import FrontSettings, drafting_state, prefix_cache_state
from glm53.settings import Settings
from kv_cache.cache import PrefixCache
from kv_cache.engine_adapter import cache_key_for
from tests.fixtures_tiny import TINY_CHUNK, fresh_engine_state, tiny_dirs, tiny_engine  # noqa: F401
from tests.prometheus_text import parse_prometheus, value

ROOT = Path(__file__).resolve().parents[1]
HOST_CHUNKS = 5  # host budget in chunks: one 3-chunk prompt fits, two distinct ones evict


# ---- the lane --------------------------------------------------------------------------------
def chunk_bytes(engine) -> int:
    """Host bytes of one cached chunk (one whole block) of this engine, measured with a throwaway cache."""
    probe = PrefixCache(cache_key_for(engine, revision="probe"))
    with fresh_engine_state(engine, prefix_cache=probe, drafter=None):
        engine.generate(list(range(3, 3 + TINY_CHUNK)), 1)  # its frontier: exactly one block, no tail
    stats = probe.stats_dict()
    assert stats["host_chunks"] == 1
    return stats["host_bytes"]


@pytest.fixture(scope="module")
def lane(tiny_dirs, tiny_engine):  # noqa: F811
    engine = tiny_engine
    cache = PrefixCache(cache_key_for(engine, revision="front-test"), host_bytes=HOST_CHUNKS * chunk_bytes(engine))
    with fresh_engine_state(engine, prefix_cache=cache, drafter=DraftPlan("copy")):
        settings = FrontSettings(context=512, default_max_tokens=8, prefix_cache=prefix_cache_state(engine),
                                 drafting=drafting_state(engine), prefill_chunk=engine.chunk)
        service = Service(engine, ChatText(tiny_dirs.model), settings, glm53_sampling)
        server = serve(service, "127.0.0.1", 0)
        try:
            yield server.url, engine, cache
        finally:
            server.shutdown()
            service.close()


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture):
    """lines() -> the front's per-request log lines so far in this test (logged by the worker thread)."""
    caplog.set_level(logging.INFO, logger="front.requests")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "front.requests"]


def metrics(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_prometheus(r.text)


def field(line: str, name: str) -> str:
    m = re.search(rf"(?:^| ){name}=(\S+)", line)
    assert m, f"{name} missing from the log line {line!r}"
    return m.group(1)


def complete(url: str, prompt: list[int] | str, max_tokens: int, draft: bool) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "draft": draft})
    assert r.status_code == 200, r.text
    return r.json()


# ---- tests -----------------------------------------------------------------------------------
def test_resend_hits_the_cache_and_metrics_match_usage(lane, lines) -> None:
    url, engine, _ = lane
    assert httpx.get(url + "/health").json()["prefix_cache"] == "on"
    before = metrics(url)
    prompt = [7 + (i * 13) % 500 for i in range(3 * TINY_CHUNK + 5)]  # three whole chunks and a tail
    first = complete(url, prompt, 4, draft=False)
    second = complete(url, prompt, 4, draft=False)
    after = metrics(url)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(prompt) - 1 and first["choices"][0]["text"] == second["choices"][0]["text"]  # all but the last

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("glm53_prefix_cache_lookups_total") == 2
    assert delta("glm53_prefix_cache_hits_total") == 1 and value(after, "glm53_prefix_cache_hits_total") > 0
    assert delta("glm53_prefix_cache_cached_tokens_total") == first["usage"]["prompt_tokens_details"]["cached_tokens"] + cached
    assert delta("glm53_cached_tokens_total") == delta("glm53_prefix_cache_cached_tokens_total")
    assert value(after, "glm53_prefix_cache_host_bytes") > 0 and value(after, "glm53_prefix_cache_host_chunks") >= 3
    assert value(after, "glm53_prefix_cache_disk_bytes") == 0  # no disk tier configured

    hit = lines()[-1]
    assert f"prompt={len(prompt)} cached={cached} prefill={len(prompt) - cached} completion=4" in hit
    assert field(hit, "cache_hits") == f"+1/{int(value(after, 'glm53_prefix_cache_hits_total'))}"
    assert field(hit, "cache_misses") == f"+0/{int(value(after, 'glm53_prefix_cache_misses_total'))}"
    assert float(field(hit, "ttft_ms")) > 0 and float(field(hit, "decode_tok_s")) > 0
    assert "draft_accepted" not in hit  # "draft": false decodes serially
    assert len(lines()) == 2 and field(lines()[0], "cached") == str(first["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_evictions_are_counted_and_logged(lane, lines) -> None:
    url, _, _ = lane
    before = metrics(url)
    for base in (600, 1200):  # two distinct 3-chunk prompts cannot share a 5-chunk budget
        complete(url, [base + i for i in range(3 * TINY_CHUNK + 1)], 1, draft=False)
    after = metrics(url)
    evicted = value(after, "glm53_prefix_cache_evictions_total") - value(before, "glm53_prefix_cache_evictions_total")
    assert evicted > 0 and value(after, "glm53_prefix_cache_host_evictions_total") >= evicted
    logged = sum(int(field(line, "cache_evictions").split("/")[0]) for line in lines())
    assert logged == evicted
    assert value(after, "glm53_prefix_cache_host_chunks") <= HOST_CHUNKS


def test_drafting_counters_in_metrics_and_log_line(lane, lines) -> None:
    url, engine, _ = lane
    assert httpx.get(url + "/health").json()["drafting"] is True
    before = metrics(url)
    # copy drafts land where the reply repeats the context; on random weights that needs a try or two
    texts = ["a b a b a b a b a b a b a b a b", "one two three four " * 12, "x = 1\nx = 1\nx = 1\n" * 6]
    accepted = proposed = 0
    for text in texts:
        reply = complete(url, text, 32, draft=True)
        got_accepted, got_proposed = map(int, field(lines()[-1], "draft_accepted").split("/"))
        engine_counts = engine.last_stats["draft"]
        assert got_accepted == engine_counts["tf_glm53_draft_accepted_total"]
        assert got_proposed == engine_counts["tf_glm53_draft_proposed_total"]
        # a drafter without cumulative stats: the engine's per-request dict gives the same numbers
        nothing = observe.Snapshot(cache=None, draft=None)
        assert observe.request_drafts(engine, nothing, nothing, engine.last_stats) == (got_accepted, got_proposed)
        assert reply["usage"]["completion_tokens"] == 32
        accepted, proposed = accepted + got_accepted, proposed + got_proposed
        if accepted > 0:
            break
    assert proposed > 0 and accepted > 0, "no copy draft landed on any of the repetitive prompts"
    after = metrics(url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0)

    assert delta("glm53_draft_proposed_total") == proposed and delta("glm53_draft_accepted_total") == accepted
    assert delta("glm53_draft_source_proposed_total", source="copy") == proposed
    assert delta("glm53_draft_source_accepted_total", source="copy") == accepted
    steps = delta("glm53_draft_verify_steps_total")
    assert steps > 0 and delta("glm53_draft_accepted_length_count") == steps
    assert delta("glm53_draft_accepted_length_sum") == accepted
    # committed tokens: the first token of each reply comes from the prefill, every other from a verify step
    assert delta("glm53_draft_committed_total") == steps + accepted
    assert value(after, "glm53_draft_accepted_length_bucket", le="0") < value(after, "glm53_draft_accepted_length_count")


def test_metrics_is_strict_prometheus_text(lane) -> None:
    url, _, _ = lane
    complete(url, "hello world", 2, draft=True)
    text = httpx.get(url + "/metrics").text
    samples = parse_prometheus(text)
    names = {name for name, _ in samples}
    assert {"glm53_prefix_cache_hits_total", "glm53_prefix_cache_misses_total", "glm53_prefix_cache_evictions_total",
            "glm53_prefix_cache_cached_tokens_total", "glm53_prefix_cache_host_bytes", "glm53_prefix_cache_disk_bytes",
            "glm53_draft_proposed_total", "glm53_draft_accepted_total", "glm53_draft_verify_steps_total",
            "glm53_draft_accepted_length_bucket", "glm53_requests_total", "glm53_queue_depth",
            "glm53_gc_pause_seconds_bucket", "glm53_step_seconds_bucket"} <= names
    assert value(samples, "glm53_step_seconds_count", kind="prefill") >= 1  # the prompt's step, timed
    assert value(samples, "glm53_step_seconds_count", kind="decode") >= 1
    assert "# TYPE glm53_prefix_cache_host_bytes gauge" in text
    assert "# TYPE glm53_draft_accepted_length histogram" in text
    # the parser itself refuses what Prometheus would
    for bad in ("glm53_x 1\n", "# HELP a b\n# TYPE a counter\nb 1\n", "# HELP a b\n# TYPE a counter\na{l=x} 1\n",
                "# HELP a b\n# TYPE a counter\na 1\na 2\n", "# HELP a b\n# TYPE a counter\na one\n",
                # a labelled histogram series whose +Inf bucket is not its own _count
                '# HELP h b\n# TYPE h histogram\nh_bucket{k="x",le="+Inf"} 2\nh_sum{k="x"} 1\nh_count{k="x"} 1\n'):
        with pytest.raises((AssertionError, ValueError)):
            parse_prometheus(bad)


def test_a_wrapping_engine_is_seen_through(lane) -> None:
    """A multi-rank engine (glm53.dist RankEngine) keeps the Glm53Engine as `.engine` and has no
    last_stats, prefix_cache or drafter of its own: the front reads the wrapped one's."""
    _, engine, _ = lane

    class Wrapper:
        def __init__(self, inner) -> None:
            self.engine, self.eos = inner, inner.eos

    wrapped = Wrapper(engine)
    assert observe.holder(wrapped) is engine
    assert observe.render(wrapped) == observe.render(engine) and "glm53_draft_proposed_total" in observe.render(wrapped)
    assert observe.render(object()) == ""  # an engine with neither: no families


def test_rank_logging_goes_to_stderr(tmp_path) -> None:
    code = ("import logging; from glm53.serving.rank import configure_logging; from glm53.settings import Settings; "
            "configure_logging(Settings.from_env().log_level); "
            "from glm53.serving.front.observe import log; log.info('request x done: prompt=3'); "
            "logging.getLogger('kv_cache.cache').debug('hidden')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": ""})
    assert run.returncode == 0 and run.stdout == ""
    assert "front.requests: request x done: prompt=3" in run.stderr and "hidden" not in run.stderr
    debug = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={"TF_GLM53_LOG_LEVEL": "debug", "PATH": ""})
    assert debug.returncode == 0 and "hidden" in debug.stderr
    # the rank parses TF_GLM53_LOG_LEVEL with every other knob at start: a bad value ends it there, named
    bad = subprocess.run([sys.executable, "-m", "glm53.serving.rank", "--model", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"TF_GLM53_LOG_LEVEL": "LOUD", "PATH": ""})
    assert bad.returncode == 2, bad.stderr
    assert "TF_GLM53_LOG_LEVEL='LOUD': expected one of DEBUG, INFO, WARNING, ERROR" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_reply_does_not_wait_for_the_store_behind_it(tiny_dirs, tiny_engine, monkeypatch) -> None:  # noqa: F811
    """With background stores (the GPU default) the reply must not wait for the store's copy: the
    front reads the cache's counters around every request and at each scrape, and those reads
    waited for a store still copying (every response, and the next lookup, held by it). Here the
    store's fill is held until the test releases it."""
    from tests.test_kv_cache_staging import held_store_fills

    go = held_store_fills(monkeypatch)
    engine = tiny_engine
    cache = PrefixCache(cache_key_for(engine, revision="front-staging"), staging_bytes=1 << 20)
    with fresh_engine_state(engine, prefix_cache=cache, drafter=None):
        settings = FrontSettings(context=512, default_max_tokens=8, prefix_cache=prefix_cache_state(engine),
                                 drafting=drafting_state(engine), prefill_chunk=engine.chunk)
        service = Service(engine, ChatText(tiny_dirs.model), settings, glm53_sampling)
        server = serve(service, "127.0.0.1", 0)
        url = server.url
        try:
            prompt = [9 + (i * 7) % 400 for i in range(3 * TINY_CHUNK + 2)]
            r = httpx.post(url + "/v1/completions", timeout=10,
                           json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "draft": False})
            assert r.status_code == 200 and cache._pending is not None, "the reply waited for its store"
            assert value(metrics(url), "glm53_prefix_cache_host_chunks") == 0  # a scrape does not wait either
            go.set()
            again = complete(url, prompt + [5], 1, draft=False)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
        finally:
            go.set()
            server.shutdown()
            service.close()
            cache.close()


def test_health_reads_the_cache_switch_as_the_cache_does(tiny_engine) -> None:  # noqa: F811
    """/health said "on" for TF_GLM53_PREFIX_CACHE=off, which the cache reads as off."""
    engine = tiny_engine
    for text in ("0", "off", "False", " no "):
        assert prefix_cache_state(engine, Settings.from_env({"TF_GLM53_PREFIX_CACHE": text})) == "off", text
    assert prefix_cache_state(engine) == "on"  # the engine's own settings: the cache on by default
    for enabled in (False, True):
        cache = PrefixCache(cache_key_for(engine, revision="health"), enabled=enabled)
        with fresh_engine_state(engine, prefix_cache=cache, drafter=None):
            assert prefix_cache_state(engine) == ("on" if enabled else "off")


def test_health_reports_what_the_rank_holds_beside_the_plan(tiny_dirs, tiny_engine) -> None:  # noqa: F811
    """/health's memory figures are the engine's load report: resident weight bytes (the packed EXL3 banks
    among them), linears decoded at load, the kernels' workspace, and the layout plan's bytes for the rank."""
    from glm53.layout.plan import plan_layout
    from glm53.model.memory import resident_bytes

    service = Service(tiny_engine, ChatText(tiny_dirs.model), FrontSettings(context=512), glm53_sampling)
    try:
        body = service.health()
    finally:
        service.close()
    memory = body["memory"]
    assert body["status"] == "ok" and memory == tiny_engine.memory
    assert memory["weights_bytes"] == resident_bytes(tiny_engine.model.w)
    assert 0 < memory["exl3_packed_bytes"] < memory["weights_bytes"]
    assert memory["planned_bytes"] == plan_layout(tiny_dirs.model, 1, tiny_engine.cfg).bytes_per_rank()[0]
    assert memory["workspace_bytes"] == 0  # the CPU path needs none (the CUDA kernels reserve theirs at load)


def test_a_request_beside_a_running_one_shares_its_prefix_pages(lane, lines) -> None:
    """B arrives while A streams and shares A's 69-token prompt prefix: B's log line says how much it
    took in place (two whole pages of 32) of what it reused, /metrics shows the pool's pages, and
    once both finished no page is held or shared."""
    url, _, _ = lane
    prefix = [300 + (i * 7) % 400 for i in range(2 * TINY_CHUNK + 5)]
    body = {"prompt": prefix + [11], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "draft": False,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as a:
        assert a.status_code == 200
        chunks = a.iter_lines()
        next(line for line in chunks if line.startswith("data: "))  # A decodes
        b = complete(url, prefix + [12], 2, draft=False)
        for _ in chunks:  # A to its end
            pass
    line = next(line for line in lines() if f"prompt={len(prefix) + 1} cached={len(prefix)}" in line)
    assert field(line, "shared") == str(2 * TINY_CHUNK)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prefix)
    after = metrics(url)
    assert value(after, "glm53_kv_pool_used_blocks") == 0 and value(after, "glm53_kv_pool_shared_blocks") == 0
    assert value(after, "glm53_kv_pool_free_blocks") > 0
