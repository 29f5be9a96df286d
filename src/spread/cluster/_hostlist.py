"""SLURM's compact host and count lists: ``node[01-03,07]`` and ``2(x3),1``.

Pure string parsing; every problem is a :class:`ClusterSpecError` naming the variable it came from.
"""

from __future__ import annotations

import re

from spread.errors import ClusterSpecError

_MAX_HOSTS = 100_000  # a nodelist range past this is a typo, not a cluster


def _split_top_level(text: str, variable: str) -> list[str]:
    """Split on commas outside brackets: ``"a1,b[2-3,5]"`` -> ``["a1", "b[2-3,5]"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ClusterSpecError(variable, "", f"unbalanced or nested brackets at position {i} in {text!r}")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ClusterSpecError(variable, "", f"unclosed '[' in {text!r}")
    return [*parts, text[start:]]


def _expand_host(pattern: str, variable: str) -> list[str]:
    if "[" not in pattern:
        if "]" in pattern or not pattern:
            raise ClusterSpecError(variable, "", f"malformed host name {pattern!r}")
        return [pattern]
    prefix, _, rest = pattern.partition("[")
    body, _, suffix = rest.partition("]")
    numbers: list[str] = []
    for item in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if match is None or int(match[2] or match[1]) < int(match[1]):
            raise ClusterSpecError(
                variable, "", f"bad range {item!r} in {pattern!r}; expected forms like 01-03 or 7"
            )
        low, high = match[1], int(match[2] or match[1])
        if high - int(low) + len(numbers) >= _MAX_HOSTS:
            raise ClusterSpecError(variable, "", f"range {item!r} expands to more than {_MAX_HOSTS} hosts")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), high + 1)]  # padded to the start's width
    tails = _expand_host(suffix, variable) if suffix else [""]
    return [f"{prefix}{n}{tail}" for n in numbers for tail in tails]


def expand_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a SLURM hostlist: ``"node[01-03,07]"`` -> node01, node02, node03, node07.

    Handles comma-separated hosts, bracketed ranges keeping the start's zero padding, and several
    bracket groups in one name (``"r[1-2]n[1-2]"``). Errors name ``variable``.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip(), variable):
        hosts += _expand_host(part.strip(), variable)
        if len(hosts) > _MAX_HOSTS:
            raise ClusterSpecError(variable, "", f"expands to more than {_MAX_HOSTS} hosts")
    return hosts


def tasks_per_node(text: str, variable: str) -> list[int]:
    """``"2(x3),1"`` -> [2, 2, 2, 1]; ``"4"`` -> [4]."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"([1-9]\d*)(?:\(x([1-9]\d*)\))?", item.strip())
        if match is None:
            raise ClusterSpecError(variable, "", f"expected counts like '4' or '2(x3),1', got {text!r}")
        counts += [int(match[1])] * min(int(match[2] or 1), _MAX_HOSTS)
    return counts
