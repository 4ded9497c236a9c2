"""The texts the suites send, shipped in glm53/apibench/texts/: the decode prompts, the agent's system
prompt and six turns, and a corpus of tool-like lines (code, test runs, logs, listings) from which
tool outputs and long documents of any size are cut, in an order fixed by a seed."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from importlib import resources

DECODE_KINDS = ("prose", "code", "structured")


@cache
def _read(name: str) -> str:
    return resources.files("glm53.apibench").joinpath("texts", name).read_text(encoding="utf-8")


def decode_prompt(kind: str) -> str:
    """The user prompt of a decode kind (prose, code or structured): each asks for a long reply."""
    if kind not in DECODE_KINDS:
        raise ValueError(f"decode kind {kind!r}: choose from {', '.join(DECODE_KINDS)}")
    return _read(f"decode_{kind}.txt").strip()


@dataclass(frozen=True)
class AgentTurn:
    call: str  # the tool call whose output the turn carries
    ask: str  # what the user asks about that output


def agent_system() -> str:
    return _read("agent_system.txt").strip()


def agent_turns() -> list[AgentTurn]:
    return [AgentTurn(**t) for t in json.loads(_read("agent_turns.json"))]


def tool_output(seed: str, chars: int) -> str:
    """About `chars` characters of tool-like output: runs of 3 to 12 consecutive corpus lines, each
    numbered like `cat -n` (so repeated runs do not repeat text), chosen by `seed`; the same seed
    and size always give the same text. At least one line."""
    lines = _read("tool_lines.txt").splitlines()
    rng = random.Random(seed)  # a str seed is hashed with SHA-512: the same order on every run
    out: list[str] = []
    size = 0
    while size < chars or not out:
        start = rng.randrange(len(lines))
        for line in lines[start:start + rng.randint(3, 12)]:
            numbered = f"{len(out) + 1:6d}  {line}"
            out.append(numbered)
            size += len(numbered) + 1
            if size >= chars:
                break
    return "\n".join(out)
