"""Copy drafts on text where they land (code, repeated structure; prose as a control):
tokens per verify step and end-to-end decode tokens/s, drafted against serial.

    python -m bench.bench_copy_drafts --out bench/results/copy_drafts.json            # tiny GLM-5.3 engine
    python -m bench.bench_copy_drafts --target reference --out /tmp/copy_drafts.json   # integer test LM
    python -m bench.bench_copy_drafts --device cuda --out bench/results/copy_drafts_cuda.json

Texts are real: the kit's own Python sources (code), a JSON-lines log with repeated keys built
from the kit's files (structured), and the kit's docs/prefix-cache.md (prose). They are tokenized with the
tiny checkpoint's byte-level BPE (glm53.synthetic.tiny_tokenizer). Each sample takes a prompt of P tokens
and decodes the next N tokens of the text.

A model with random weights does not write code, so the target is FORCED to follow the text: the
real forward runs (its real cost, window by window, through the real cache and truncation), then
each logits row is replaced by one that puts the text's next token first. Serial and drafted runs
produce the same tokens (asserted), and the drafted run's accepted lengths are exactly what copy
drafts would achieve on a model that writes this text. MTP / DFlash2 acceptance on random weights
means nothing and is not measured here.

Reported per text: tokens per verify step (committed / verify forwards), draft acceptance, decode
tokens/s serial and drafted ((tokens - 1) / (t_last - t_first), tokens counted by the
loop), and the speedup, measured side by side (serial and drafted interleaved, warm-up discarded).
On the CPU the tiny model's forward is overhead-bound, so its speedup tracks the forward count;
the GPU cost of a window at real dimensions is bench_verify_window.py's number.
Exit 0 on success; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.lib.meta import KIT_ROOT, result_header
from glm53.measurement import write_json
from drafter.decode_loop import StopRule, drafted_decode, serial_decode
from drafter.policy import AdaptiveDepth, PolicyConfig
from drafter.sources import CopySource
from drafter.target import WindowOutput


def tracked_python_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=KIT_ROOT, capture_output=True, text=True, check=True).stdout
        files = [KIT_ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        files = []
    # a copy without its own .git (the GPU machine) may sit inside another repository: walk the tree
    return files or sorted(p for p in KIT_ROOT.rglob("*.py") if ".venv" not in p.parts)


def texts(limit_chars: int = 200_000) -> dict[str, str]:
    code = "\n\n".join(p.read_text() for p in sorted((KIT_ROOT / "drafter").rglob("*.py")))
    records = []
    for i, p in enumerate(tracked_python_files()[:400]):
        if p.is_file():
            records.append(json.dumps({"id": i, "path": p.relative_to(KIT_ROOT).as_posix(), "kind": "python",
                                       "lines": len(p.read_text(errors="replace").splitlines()), "status": "ok"}))
    prose_text = (KIT_ROOT / "docs" / "prefix-cache.md").read_text()
    return {"code": code[:limit_chars], "structured": "\n".join(records)[:limit_chars], "prose": prose_text[:limit_chars]}


class ForcedTarget:
    """A real target whose logits rows are replaced so that the text's next token wins."""

    def __init__(self, inner, text_ids: list[int]) -> None:
        self.inner, self.text = inner, text_ids
        self.vocab_size = inner.vocab_size

    def length(self) -> int:
        return self.inner.length()

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)

    def canonical_frontier(self) -> int:
        return self.inner.canonical_frontier()

    def forward(self, tokens, start, *, taps=()) -> WindowOutput:
        out = self.inner.forward(tokens, start, taps=taps)
        forced = torch.full_like(out.logits, -1e4)
        for i in range(out.rows):
            forced[i, self.text[start + i + 1]] = 0.0
        out.logits = forced
        return out


def make_targets(kind: str, device: str, vocab_needed: int):
    """-> (new_target(prompt_len) factory, description)."""
    if kind == "reference":
        from drafter.reference_lm import ReferenceLM, ReferenceLMConfig
        model = ReferenceLM(ReferenceLMConfig(vocab_size=max(vocab_needed, 96)))
        return (lambda prompt_len: model.session()), "drafter.reference_lm (integer LM, CPU)"
    from glm53.runtime.engine import Glm53Engine, Glm53Target
    from glm53.synthetic.tiny import write_tiny_checkpoint
    tmp = Path(tempfile.mkdtemp(prefix="bench_copy_tiny_"))
    print(f"[bench_copy_drafts] writing the tiny checkpoint to {tmp}", file=sys.stderr, flush=True)
    write_tiny_checkpoint(tmp / "tiny")
    engine = Glm53Engine(tmp / "tiny", device=device)
    return (lambda prompt_len: Glm53Target(engine, engine.model.new_state(engine.kv_dtype), prompt_len)), \
        f"glm53 engine on the tiny checkpoint ({device}, {engine.dtype_name})"


def decode_rate(stamps: list[tuple[float, int]]) -> float:
    """(tokens - 1) / (t_last - t_first) from (time, tokens in batch) stamps."""
    total = sum(n for _, n in stamps)
    if total < 2 or stamps[-1][0] <= stamps[0][0]:
        return float("nan")
    # the first stamp's batch holds the first token; tokens after it arrive by the last stamp
    return (total - 1) / (stamps[-1][0] - stamps[0][0])


def run_one(new_target, ids: list[int], begin: int, prompt_len: int, n: int, drafted: bool, sync) -> dict:
    text = ids[begin:begin + prompt_len + n + 1]
    target = ForcedTarget(new_target(prompt_len), text)
    stamps: list[tuple[float, int]] = []

    def on_tokens(new: list[int]) -> None:
        sync()
        stamps.append((time.perf_counter(), len(new)))

    greedy = lambda row, pos: int(torch.argmax(row))  # noqa: E731
    stop = StopRule(max_tokens=n)
    prompt = text[:prompt_len]
    if drafted:
        res = drafted_decode(target, prompt, greedy, stop, CopySource(), on_tokens=on_tokens,
                             policy=AdaptiveDepth(PolicyConfig()))
    else:
        res = serial_decode(target, prompt, greedy, stop, on_tokens=on_tokens)
    assert res.tokens == text[prompt_len:prompt_len + n], "forced decoding must reproduce the text"
    steps = max(res.forwards - 1, 1)      # verify forwards after the prefill
    return {"tokens": len(res.tokens), "forwards": res.forwards, "tok_per_step": (len(res.tokens) - 1) / steps,
            "proposed": res.stats.proposed, "accepted": res.stats.accepted,
            "histogram": res.stats.histogram, "decode_tok_s": decode_rate(stamps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("glm53-tiny", "reference"), default="glm53-tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--samples", type=int, default=4, help="windows of text per kind (different offsets)")
    ap.add_argument("--out", default="bench/results/copy_drafts.json")
    args = ap.parse_args()
    if args.prompt_tokens < 8 or args.new_tokens < 2 or args.samples < 1:
        print("bench_copy_drafts: need --prompt-tokens >= 8, --new-tokens >= 2, --samples >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_copy_drafts: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    from glm53.synthetic.tiny_tokenizer import build_tokenizer
    print("[bench_copy_drafts] building the tokenizer and encoding the texts", file=sys.stderr, flush=True)
    tok = build_tokenizer()
    encoded = {name: tok.encode(t).ids for name, t in texts().items()}
    vocab_needed = max(max(ids) for ids in encoded.values()) + 1
    new_target, target_desc = make_targets(args.target, args.device, vocab_needed)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    span = args.prompt_tokens + args.new_tokens + 1
    results = []
    for name, ids in encoded.items():
        if len(ids) < span:
            print(f"bench_copy_drafts: text '{name}' has {len(ids)} tokens, fewer than {span}; skipped", file=sys.stderr)
            continue
        offsets = [int(i * (len(ids) - span) / max(args.samples, 1)) for i in range(args.samples)]
        run_one(new_target, ids, offsets[0], args.prompt_tokens, args.new_tokens, True, sync)     # warm-up
        run_one(new_target, ids, offsets[0], args.prompt_tokens, args.new_tokens, False, sync)
        pairs = []
        for off in offsets:
            print(f"[bench_copy_drafts] {name} @ {off}", file=sys.stderr, flush=True)
            s = run_one(new_target, ids, off, args.prompt_tokens, args.new_tokens, False, sync)
            d = run_one(new_target, ids, off, args.prompt_tokens, args.new_tokens, True, sync)
            pairs.append({"offset": off, "serial": s, "drafted": d, "speedup": d["decode_tok_s"] / s["decode_tok_s"]})
        results.append({"text": name, "tokens_in_text": len(ids), "samples": pairs})

    def med(xs):
        return statistics.median(xs), min(xs), max(xs)

    for r in results:
        p = r["samples"]
        r["summary"] = {
            "tok_per_step": med([x["drafted"]["tok_per_step"] for x in p]),
            "acceptance": sum(x["drafted"]["accepted"] for x in p) / max(1, sum(x["drafted"]["proposed"] for x in p)),
            "serial_tok_s": med([x["serial"]["decode_tok_s"] for x in p]),
            "drafted_tok_s": med([x["drafted"]["decode_tok_s"] for x in p]),
            "speedup": med([x["speedup"] for x in p]),
        }
    settings = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "samples": args.samples,
                "source": "copy (min_ngram 2, max_ngram 8)", "policy": "AdaptiveDepth default (max 13)",
                "forced_to_text": True, "tokenizer": "glm53.synthetic.tiny_tokenizer byte-level BPE", "ranks": 1,
                "prefix_cache": "off (each sample a fresh cache)"}
    result = {**result_header("copy_drafts", settings, device=args.device),
              "torch": torch.__version__, "target": target_desc, "results": results}
    out = write_json(args.out, result)
    print(f"wrote {out}", file=sys.stderr)
    print(f"copy drafts, {target_desc}; median (min-max) over {args.samples} windows of {args.new_tokens} tokens")
    print(f"{'text':<11}{'tok/step':>20}{'accept':>8}{'serial tok/s':>22}{'drafted tok/s':>22}{'speedup':>20}")
    for r in results:
        s = r["summary"]
        cell = lambda t, f: f"{t[0]:{f}} ({t[1]:{f}}-{t[2]:{f}})"  # noqa: E731
        print(f"{r['text']:<11}{cell(s['tok_per_step'], '.2f'):>20}{s['acceptance']:>8.2f}"
              f"{cell(s['serial_tok_s'], '.0f'):>22}{cell(s['drafted_tok_s'], '.0f'):>22}{cell(s['speedup'], '.2f'):>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
