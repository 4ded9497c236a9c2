"""A strict parser of Prometheus text exposition (0.0.4), for the tests of /metrics."""
from __future__ import annotations

import math
import re

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"'
SAMPLE = re.compile(rf"^({NAME})(\{{(?:{LABEL})(?:,{LABEL})*\}})? (\S+)$")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value}. Fails on anything the format does not allow: a sample
    before its family's HELP and TYPE, a family declared twice or interleaved, an unknown type, a
    sample name that is not its family's, a duplicate series, a malformed line or value, histogram
    buckets that are not cumulative or whose +Inf bucket differs from _count (each labelled series apart)."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    closed: set[str] = set()
    current: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        where = f"line {number}: {line!r}"
        assert line.strip() == line and line, f"{where}: blank or padded line"
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(NAME, name) and help_text, where
            assert name not in helps and name not in closed, f"{where}: family declared twice"
            if current is not None:
                closed.add(current)
            helps[name], current = help_text, name
            continue
        if line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and name not in types, f"{where}: TYPE must follow its HELP"
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), where
            types[name] = kind
            continue
        assert not line.startswith("#"), f"{where}: unknown comment"
        m = SAMPLE.match(line)
        assert m, f"{where}: malformed sample"
        name, labels_text, value_text = m.groups()
        assert current is not None and current in types, f"{where}: sample before HELP/TYPE"
        if types[current] == "histogram":
            assert name in tuple(current + s for s in HISTOGRAM_SUFFIXES), f"{where}: not of {current}"
        else:
            assert name == current, f"{where}: sample of family {current}"
        labels = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels_text or "")))
        assert len({k for k, _ in labels}) == len(labels), f"{where}: repeated label"
        value = float(value_text)  # raises on a malformed value
        assert not math.isnan(value), where
        if types[current] == "counter":
            assert value >= 0, f"{where}: negative counter"
        key = (name, labels)
        assert key not in samples, f"{where}: duplicate series"
        samples[key] = value
    for family, kind in types.items():
        if kind != "histogram":
            continue
        # a series a label set (the `le` label aside): each cumulative, its +Inf bucket its _count
        series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for (n, lab), v in samples.items():
            if n == family + "_bucket":
                le = dict(lab)["le"]
                rest = tuple(kv for kv in lab if kv[0] != "le")
                series.setdefault(rest, []).append((math.inf if le == "+Inf" else float(le), v))
        assert series, f"{family}: no buckets"
        for rest, points in series.items():
            buckets = sorted(points)
            where = f"{family}{dict(rest) or ''}"
            assert buckets[-1][0] == math.inf, f"{where}: no +Inf bucket"
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"{where}: buckets not cumulative"
            assert buckets[-1][1] == samples[(family + "_count", rest)], f"{where}: +Inf bucket != _count"
            assert (family + "_sum", rest) in samples, f"{where}: no _sum"
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]
