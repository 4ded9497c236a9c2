"""agent: the shipped six-turn conversation of a coding agent (system prompt, then per turn a tool's
output of ~`agent_turn_tokens` tokens and a question), replies of `agent_reply_tokens` appended
as the conversation goes. Each turn is sent with the cache on, then at once the same messages with
the cache off (CacheOff says how), so the two compare side by side; per turn: prompt tokens,
cached tokens, wall time, and the speedup of the cache."""
from __future__ import annotations

import secrets
from typing import Any

from glm53.apibench.context import RunContext
from glm53.apibench.endpoint import Endpoint
from glm53.apibench.schema import AgentRequest, AgentSuite, AgentTurnRow, CacheOff
from glm53.apibench.stats import ratio, summarize
from glm53.apibench.streaming import chat
from glm53.apibench.texts import AgentTurn, agent_system, agent_turns, tool_output


def cache_off(ctx: RunContext) -> CacheOff:
    s = ctx.settings
    if ctx.no_cache is not None:
        return CacheOff(mode="url", url=ctx.no_cache.base, body=None)
    if s.no_cache_body is not None:
        return CacheOff(mode="body", url=None, body=s.no_cache_body)
    return CacheOff(mode="salt", url=None, body=None)


def turn_text(turn: AgentTurn, number: int, tokens: int, chars_per_token: float) -> str:
    head, tail = f"Output of {turn.call}:\n", f"\n\n{turn.ask}"
    chars = max(1, round(tokens * chars_per_token) - len(head) - len(tail))
    return head + tool_output(f"agent-turn-{number}", chars) + tail


def system(session: str) -> dict[str, str]:
    """The system prompt under a first line naming the session: the first token that differs between
    sessions comes right after the chat template's opening."""
    return {"role": "system", "content": f"Session {session}.\n{agent_system()}"}


def run(ctx: RunContext) -> AgentSuite:
    s = ctx.settings
    off = cache_off(ctx)
    off_endpoint: Endpoint = ctx.no_cache or ctx.endpoint
    off_body = ctx.body(**(s.no_cache_body or {})) if off.mode == "body" else ctx.body()
    warmups = ctx.warm_up()
    cpt = ctx.chars_per_token()
    script = agent_turns()
    ctx.check_fits(round(len(agent_system()) / cpt) + s.agent_turns * (s.agent_turn_tokens + s.agent_reply_tokens),
                   "--agent-turns or --agent-turn-tokens")
    progress = ctx.display.suite("agent", s.agent_samples * s.agent_turns * 2)
    requests: list[AgentRequest] = []
    for sample in range(s.agent_samples):
        session = f"{ctx.run_id}-agent-{sample}"
        history: list[dict[str, Any]] = []
        for t in range(1, s.agent_turns + 1):
            history.append({"role": "user", "content": turn_text(script[(t - 1) % len(script)], t,
                                                                 s.agent_turn_tokens, cpt)})
            on = chat(ctx.endpoint, [system(session), *history], s.agent_reply_tokens,
                      f"agent turn {t} (cache on)", ctx.body())
            requests.append(AgentRequest(**on.timing.model_dump(), sample=sample, turn=t, cache="on"))
            progress.step(f"sample {sample + 1} turn {t} cache on: {on.timing.wall_s:.3f} s, "
                          f"{on.timing.cached_tokens} of {on.timing.prompt_tokens} cached")
            off_session = secrets.token_hex(6) if off.mode == "salt" else session  # salt: its very first token
            cold = chat(off_endpoint, [system(off_session), *history], s.agent_reply_tokens,
                        f"agent turn {t} (cache off, {off.mode})", off_body)
            requests.append(AgentRequest(**cold.timing.model_dump(), sample=sample, turn=t, cache="off"))
            progress.step(f"sample {sample + 1} turn {t} cache off: {cold.timing.wall_s:.3f} s")
            history.append({"role": "assistant", "content": on.text})
    turns = [_row(requests, t) for t in range(1, s.agent_turns + 1)]
    return AgentSuite(cache_off=off, chars_per_token=cpt, warmup_requests=warmups, turns=turns,
                      last_over_first_on=ratio(turns[-1].wall_on_s, turns[0].wall_on_s), requests=requests)


def _row(requests: list[AgentRequest], turn: int) -> AgentTurnRow:
    on = [r for r in requests if r.turn == turn and r.cache == "on"]
    off = [r for r in requests if r.turn == turn and r.cache == "off"]
    before = {r.sample: r.prompt_tokens for r in requests if r.turn == turn - 1 and r.cache == "on"}
    wall_on, wall_off = summarize(r.wall_s for r in on), summarize(r.wall_s for r in off)
    ttft_on, ttft_off = summarize(r.ttft_s for r in on), summarize(r.ttft_s for r in off)
    return AgentTurnRow(turn=turn, prompt_tokens=summarize(r.prompt_tokens for r in on),
                        new_prompt_tokens=summarize(r.prompt_tokens - before.get(r.sample, 0) for r in on),
                        cached_on=summarize(r.cached_tokens for r in on),
                        cached_off=summarize(r.cached_tokens for r in off),
                        wall_on_s=wall_on, wall_off_s=wall_off, ttft_on_s=ttft_on, ttft_off_s=ttft_off,
                        speedup=ratio(wall_off, wall_on), ttft_speedup=ratio(ttft_off, ttft_on))
