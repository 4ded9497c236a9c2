"""concurrency: N clients at once for each N asked (1, 2, 4, 8, 16 by default), `concurrency_rounds`
rounds each. Every client streams one request of `concurrency_tokens` new tokens on a decode prompt
(the kinds asked, in turn) under a first line naming the client, so no two share a prefix beyond
the template. Per N: aggregate tok/s (all completion tokens over the round's wall time),
per-stream decode tok/s, and time to first token p50/p99 over every stream."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from glm53.apibench.context import RunContext
from glm53.apibench.progress import SuiteProgress
from glm53.apibench.schema import ConcurrencySuite, Level, Stream
from glm53.apibench.stats import latency, summarize
from glm53.apibench.streaming import Reply, chat
from glm53.apibench.texts import decode_prompt


def run(ctx: RunContext) -> ConcurrencySuite:
    s = ctx.settings
    warmups = ctx.warm_up()
    progress = ctx.display.suite("concurrency", s.concurrency_rounds * sum(s.concurrency))
    streams: list[Stream] = []
    for n in s.concurrency:
        for rnd in range(s.concurrency_rounds):
            replies = _round(ctx, n, rnd, progress)
            t0 = min(r.started for r in replies)
            streams += [Stream(**r.timing.model_dump(), clients=n, round=rnd, client=k, start_s=r.started - t0,
                               end_s=r.ended - t0) for k, r in enumerate(replies)]
    return ConcurrencySuite(warmup_requests=warmups, levels=[_level(streams, n, s.concurrency_rounds)
                                                             for n in s.concurrency], streams=streams)


def _round(ctx: RunContext, n: int, rnd: int, progress: SuiteProgress) -> list[Reply]:
    """n clients, each on its own thread, released together; their replies in client order."""
    s = ctx.settings
    gate = threading.Barrier(n)

    def client(k: int) -> Reply:
        line = f"Client {k + 1} of {n}, round {rnd + 1}, session {ctx.run_id}."
        prompt = decode_prompt(s.decode_kinds[k % len(s.decode_kinds)])
        gate.wait()
        reply = chat(ctx.endpoint, [{"role": "user", "content": f"{line}\n{prompt}"}], s.concurrency_tokens,
                     f"concurrency {n} client {k + 1}", ctx.body())
        progress.step(f"{n} clients, round {rnd + 1}: client {k + 1} {reply.timing.completion_tokens} tokens")
        return reply

    with ThreadPoolExecutor(max_workers=n) as pool:
        return [f.result() for f in [pool.submit(client, k) for k in range(n)]]


def _level(streams: list[Stream], n: int, rounds: int) -> Level:
    mine = [x for x in streams if x.clients == n]
    aggregate = []
    for rnd in range(rounds):
        group = [x for x in mine if x.round == rnd]
        aggregate.append(sum(x.completion_tokens for x in group) / max(x.end_s for x in group))
    return Level(clients=n, aggregate_tok_s=summarize(aggregate),
                 per_stream_tok_s=summarize(x.decode_tok_s for x in mine), ttft_s=latency(x.ttft_s for x in mine))
