"""decode: the shipped prose, code and structured prompts, `decode_tokens` new tokens at temperature
0, `samples` times each; time to first token and decode tok/s apart. Drafting as the server does
it by default and with `"draft": false` (where the server takes the field), interleaved on the same
prompt so the two compare side by side."""
from __future__ import annotations

import openai

from glm53.apibench.context import RunContext
from glm53.apibench.endpoint import BenchError
from glm53.apibench.schema import DecodeCase, DecodeSample, DecodeSuite, DraftField
from glm53.apibench.stats import ratio, summarize
from glm53.apibench.streaming import chat
from glm53.apibench.texts import decode_prompt


def draft_field(ctx: RunContext) -> DraftField:
    """Whether the server takes `"draft": false`: a short request with it; a 4xx answer means no."""
    try:
        chat(ctx.endpoint, [{"role": "user", "content": "Say hello."}], 2, 'a request with "draft": false',
             {"draft": False})
    except BenchError as exc:
        if isinstance(exc.__cause__, openai.APIStatusError) and 400 <= exc.__cause__.status_code < 500:
            return DraftField(accepted=False, error=str(exc), server_drafting=ctx.server.drafting)
        raise
    return DraftField(accepted=True, error=None, server_drafting=ctx.server.drafting)


def run(ctx: RunContext) -> DecodeSuite:
    s = ctx.settings
    warmups = ctx.warm_up()
    draft = draft_field(ctx)
    warmups += 1
    modes = ["default", "draft_false"] if draft.accepted else ["default"]
    progress = ctx.display.suite("decode", s.samples * len(s.decode_kinds) * len(modes))
    samples: list[DecodeSample] = []
    for i in range(s.samples):
        for kind in s.decode_kinds:
            messages = [{"role": "user", "content": decode_prompt(kind)}]
            for mode in modes:
                body = ctx.body(draft=False) if mode == "draft_false" else ctx.body()
                reply = chat(ctx.endpoint, messages, s.decode_tokens, f"decode {kind} ({mode}) sample {i + 1}", body)
                samples.append(DecodeSample(**reply.timing.model_dump(), kind=kind, mode=mode, sample=i))
                rate = reply.timing.decode_tok_s
                progress.step(f"{kind} {mode} {i + 1}/{s.samples}: "
                              f"{reply.timing.completion_tokens} tokens, {rate or 0:.1f} tok/s")
    cases = []
    for kind in s.decode_kinds:
        for mode in modes:
            mine = [x for x in samples if x.kind == kind and x.mode == mode]
            cases.append(DecodeCase(kind=kind, mode=mode, ttft_s=summarize(x.ttft_s for x in mine),
                                    decode_tok_s=summarize(x.decode_tok_s for x in mine),
                                    completion_tokens=summarize(x.completion_tokens for x in mine)))
    by = {(c.kind, c.mode): c for c in cases}
    ratios = {kind: ratio(by[(kind, "default")].decode_tok_s, by[(kind, "draft_false")].decode_tok_s)
              if draft.accepted else None for kind in s.decode_kinds}
    return DecodeSuite(draft_field=draft, warmup_requests=warmups, cases=cases, default_over_draft_false=ratios,
                       samples=samples)
