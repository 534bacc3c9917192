"""Collectives of a compiled program, read from its HLO: the bytes each chip sends over the
chips' interconnect (ICI), by kind.

A partitioned program's collectives are ops of its HLO, each with its result's per-chip
shape and the replica groups it runs over (n chips a group). A collective inside a loop
(the scan over layers, over minibatches, a decode chunk's steps) runs once per
iteration: a while loop's body counts as many times as its condition's bound, `i < K`
(a loop whose bound is not a constant, decoding until every row ends, counts once).
Over a ring of n chips, per chip:
- all-gather of a result of R bytes receives R (n - 1) / n;
- reduce-scatter to a result of R bytes (its shard) moves R (n - 1);
- all-reduce of R bytes moves 2 R (n - 1) / n (a reduce-scatter, then an all-gather);
- all-to-all of R bytes moves R (n - 1) / n;
- collective-permute of R bytes moves R.
Asynchronous pairs (`*-start` / `*-done`) count once, at their start.
"""

from __future__ import annotations

import math
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_OP = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s4": 0.5, "u4": 0.5}


def _bytes(dtype: str, dims: str) -> float:
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    if dtype in _ITEMSIZE:
        return n * _ITEMSIZE[dtype]
    try:
        return n * np.dtype(_NUMPY.get(dtype, dtype)).itemsize
    except TypeError:  # a type numpy does not name: its width is in its name (f8, c64)
        bits = re.search(r"(\d+)", dtype)
        return n * (int(bits.group(1)) / 8 if bits else 4)


_NUMPY = {"bf16": "float16", "f16": "float16", "f32": "float32", "f64": "float64"}
_NUMPY.update({f"s{b}": f"int{b}" for b in (8, 16, 32, 64)})
_NUMPY.update({f"u{b}": f"uint{b}" for b in (8, 16, 32, 64)})
_NUMPY.update({"f8e4m3fn": "uint8", "f8e5m2": "uint8", "f8e4m3": "uint8"})


def _arrays(shape: str) -> list[float]:
    return [_bytes(m["dtype"], m["dims"]) for m in _ARRAY.finditer(shape)]


def group_size(line: str) -> int:
    """Chips in one replica group of a collective's HLO line (1 when it says none)."""
    m = re.search(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<over>[^}]*)\}", line)
    if m:  # mesh['data'=4,'fsdp'=16] {'fsdp'}: the product of the named axes' sizes
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m["axes"]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m["over"]))
    m = re.search(r"replica_groups=\[(?P<shape>[0-9,]+)\]<=", line)
    if m:  # iota groups [G, S]<=[N]: G groups of S
        return int(m["shape"].split(",")[-1])
    m = re.search(r"replica_groups=\{\{(?P<first>[0-9,]*)\}", line)
    if m:
        return len([x for x in m["first"].split(",") if x])
    return 1


def _line_bytes(line: str) -> tuple[str, float] | None:
    """(kind, bytes per chip) of one HLO line's collective, None when it has none."""
    m = _OP.search(line)
    if m is None:
        return None
    kind, sizes = m["kind"], _arrays(m["shape"])
    if not sizes:
        return None
    # An async start returns a tuple: the operand, the result and context; the result
    # is the largest array for a gather, the first for the others.
    r = max(sizes) if kind == "all-gather" else sizes[0]
    if not m["start"] and len(sizes) > 1 and kind == "all-reduce":
        r = sum(sizes)  # one all-reduce of several arrays (a combined reduction)
    if kind == "collective-permute":
        return kind, r
    n = group_size(line)
    if n <= 1:
        return None
    factor = {"reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n}
    return kind, r * factor.get(kind, (n - 1) / n)


_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[^\s(]+)\s.*\{\s*$")
_WHILE = re.compile(r"\bwhile\(.*?condition=%(?P<cond>[^\s,]+),\s*body=%(?P<body>[^\s,]+)")
_CALLS = re.compile(r"\bcalls=%(?P<name>[^\s,]+)")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{(?P<list>[^}]*)\})|"
    r"(?:true_computation=%(?P<t>[^\s,]+),\s*false_computation=%(?P<f>[^\s,]+))"
)
_BOUND = re.compile(r"constant\((?P<k>\d+)\)")


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m["name"]
                comps[current] = []
                if m["entry"]:
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _trip_count(cond: list[str], line: str) -> int:
    """Iterations of a while loop: XLA's known trip count, else the K of a condition
    `counter < K` (a scan's), else 1."""
    m = re.search(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)', line)
    if m:
        return int(m.group(1))
    bounds = [int(k.group("k")) for ln in cond for k in _BOUND.finditer(ln) if "s32[]" in ln]
    lt = any("direction=LT" in ln for ln in cond)
    return bounds[0] if lt and len(bounds) == 1 else 1


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """{kind: bytes per chip} that one run of a compiled program's HLO sends, every loop
    iteration counted. Text without computations (a bare line) counts its lines once."""
    comps, entry = _computations(hlo_text)
    if entry is None:
        comps, entry = {"": hlo_text.splitlines()}, ""
    memo: dict[str, dict[str, float]] = {}

    def total(name: str, seen: frozenset) -> dict[str, float]:
        if name in memo:
            return memo[name]
        out = dict.fromkeys(KINDS, 0.0)
        if name not in comps or name in seen:
            return out
        seen = seen | {name}
        for line in comps[name]:
            own = _line_bytes(line)
            if own is not None:
                out[own[0]] += own[1]
            children: list[tuple[list[str], int]] = []
            if (w := _WHILE.search(line)) is not None:
                trips = _trip_count(comps.get(w["cond"], []), line)
                children.append(([w["body"]], trips))
            elif (c := _CALLS.search(line)) is not None:
                children.append(([c["name"]], 1))
            if (b := _BRANCHES.search(line)) is not None:
                names = re.findall(r"%([^\s,}]+)", b["list"]) if b["list"] else [b["t"], b["f"]]
                children.append((names, 1))
            for names, times in children:
                # Of a conditional's branches, the one that sends the most.
                sub = [total(n, seen) for n in names]
                best = max(sub, key=lambda d: sum(d.values()))
                for k in KINDS:
                    out[k] += times * best[k]
        memo[name] = out
        return out

    return total(entry, frozenset())
