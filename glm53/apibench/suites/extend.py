"""extend: a prompt of ~`extend_tokens` tokens (a long tool log under a question) sent cold, then at
once the same prompt extended by one word: what reusing a long prefix saves. Each sample opens
with its own session line, so its cold request finds nothing cached."""
from __future__ import annotations

from glm53.apibench.context import RunContext
from glm53.apibench.schema import ExtendLeg, ExtendRequest, ExtendSuite
from glm53.apibench.stats import ratio, summarize
from glm53.apibench.streaming import chat
from glm53.apibench.texts import tool_output

QUESTION = "\n\nWhich problems does the output above show? Answer in one line each."
ONE_WORD = " Briefly."


def run(ctx: RunContext) -> ExtendSuite:
    s = ctx.settings
    warmups = ctx.warm_up()
    cpt = ctx.chars_per_token()
    ctx.check_fits(s.extend_tokens + s.extend_reply_tokens + 8, "--extend-tokens")
    document = tool_output("extend", max(1, round(s.extend_tokens * cpt) - len(QUESTION)))
    progress = ctx.display.suite("extend", 2 * s.extend_samples)
    requests: list[ExtendRequest] = []
    for sample in range(s.extend_samples):
        prompt = f"Session {ctx.run_id}-extend-{sample}.\n{document}{QUESTION}"
        for leg, content in (("cold", prompt), ("extended", prompt + ONE_WORD)):
            reply = chat(ctx.endpoint, [{"role": "user", "content": content}], s.extend_reply_tokens,
                         f"extend sample {sample + 1} ({leg})", ctx.body())
            requests.append(ExtendRequest(**reply.timing.model_dump(), sample=sample, leg=leg))
            progress.step(f"sample {sample + 1} {leg}: {reply.timing.prompt_tokens} tokens "
                          f"({reply.timing.cached_tokens} cached), {reply.timing.wall_s:.3f} s")
    cold, extended = (_leg([r for r in requests if r.leg == leg]) for leg in ("cold", "extended"))
    return ExtendSuite(chars_per_token=cpt, warmup_requests=warmups, cold=cold, extended=extended,
                       ttft_speedup=ratio(cold.ttft_s, extended.ttft_s),
                       wall_speedup=ratio(cold.wall_s, extended.wall_s), requests=requests)


def _leg(requests: list[ExtendRequest]) -> ExtendLeg:
    return ExtendLeg(prompt_tokens=summarize(r.prompt_tokens for r in requests),
                     cached_tokens=summarize(r.cached_tokens for r in requests),
                     ttft_s=summarize(r.ttft_s for r in requests), wall_s=summarize(r.wall_s for r in requests))
