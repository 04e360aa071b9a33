"""The numbers a script prints, 1 process against N: a metric that rank 0 prints N times
larger, traced to the script's own ``all_reduce(SUM)`` that returned it (the ranks' values
added and never divided by the world size); any other number rank 0 prints after training began
that differs from what 1 process prints at the same point, where 1 process printed it alike
twice (a value computed from rank 0's part of the data, never reduced).
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, List, Optional, Tuple

from .records import RunRecord

__all__ = ["numbers", "template", "summed_metric", "printed_differs", "printed_notes",
           "accumulated"]

_NUMBER = re.compile(r"[-+]?\d+(?:\.(\d+))?(?:[eE][-+]?\d+)?")


def numbers(line: str) -> List[Tuple[float, float]]:
    """The numbers in a printed line, each with half of its last printed digit (the rounding).

    Example::

        numbers("loss 2.3026 acc 51.5%")   # [(2.3026, 5e-05), (51.5, 0.05)]
    """
    out = []
    for m in _NUMBER.finditer(line):
        text = m.group(0)
        exponent = float("1e" + text.lower().split("e")[1]) if "e" in text.lower() else 1.0
        out.append((float(text), 0.5 * 10.0 ** -len(m.group(1) or "") * exponent))
    return out


def template(line: str) -> str:
    """The line with its numbers replaced by ``#``: lines of the same print statement match.

    Example::

        template("epoch 3 loss 2.30")   # 'epoch # loss #'
    """
    return _NUMBER.sub("#", line)


def _pairs(one: List[str], many: List[str]) -> Iterator[Tuple[str, str]]:
    """Lines of the same template, in the order printed (the k-th with the k-th)."""
    seen: Dict[str, List[str]] = {}
    for line in one:
        seen.setdefault(template(line), []).append(line)
    used: Dict[str, int] = {}
    for line in many:
        key = template(line)
        k = used.get(key, 0)
        if "#" in key and k < len(seen.get(key, [])):
            used[key] = k + 1
            yield seen[key][k], line


def _sums(many: RunRecord) -> List[Tuple[float, str]]:
    """Rank 0's results of the script's own SUM reductions, with their call sites."""
    calls = many.collectives[0] if many.collectives else []
    return [(v, c["site"]) for c in calls if c.get("fn") in ("all_reduce", "reduce")
            and c.get("op") in (None, "SUM") and not c.get("grad")
            for v in (c.get("after") or [])]


def summed_metric(one: RunRecord, many: RunRecord) -> Optional[Tuple[str, str, List[str]]]:
    """``(cause, sentence, evidence)`` when rank 0 prints a number about N times the
    1-process one and that number is what one of its SUM all-reduces returned; else None.

    Example::

        summed_metric(one, many)   # ('metric-summed', "rank 0 prints 'val loss 4.61' ...", [...])
    """
    n = many.world_size
    sums = _sums(many)
    if n < 2 or not sums or not one.prints or not many.prints:
        return None
    for line_one, line_many in _pairs(one.prints[0], many.prints[0]):
        for (a, da), (b, db) in zip(numbers(line_one), numbers(line_many)):
            if not a or abs(b - a) <= da + db or abs(b / a - n) > 0.05 * n:
                continue
            site = next((s for v, s in sums if abs(v - b) <= db + 1e-6 * abs(b)), None)
            if site is None:
                continue
            return ("metric-summed",
                    f"rank 0 prints {line_many.strip()!r} on {n} processes where 1 process "
                    f"prints {line_one.strip()!r}: {b:g} is {b / a:.2f}x {a:g}, the value the "
                    f"script's all_reduce(SUM) at {site} returns (the ranks' values added, "
                    "never divided by the world size): divide by it, or reduce (sum, count) "
                    "and divide the sums (rt.mean does this)",
                    [f"all_reduce(SUM) at {site} on rank 0 returned {b:g}",
                     f"printed on 1 process: {line_one.strip()!r}",
                     f"printed on {n} processes: {line_many.strip()!r}"])
    return None



def _is_float(text: str) -> bool:
    return "." in text or "e" in text.lower()


def printed_differs(one: RunRecord, many: RunRecord, again: Optional[RunRecord],
                    band: float = 1e-6) -> Optional[Tuple[str, str, List[str]]]:
    """``(cause, sentence, evidence)`` for the first number (with a decimal point) rank 0
    prints after an evaluation on N processes that differs from the 1-process line of the same
    print beyond its rounding and ``band`` (relative, at least 1e-5), where 1 process printed
    it alike twice (``again``: a time or a rate is no metric) and nothing random was drawn
    since the step before; else None. Integers (counts, sizes per rank) are left out.

    Example::

        printed_differs(one, many, again)   # ('printed-metric', "rank 0 prints 'acc 0.81' ...", ...)
    """
    found = _first_difference("eval_prints", one, many, again, band)
    if found is None:
        return None
    line_one, line_many, a, b = found
    return ("printed-metric",
            f"rank 0 prints {line_many!r} after an evaluation on {many.world_size} processes "
            f"where 1 process prints {line_one!r} at the same point ({b:g} against {a:g}), "
            "though the steps compared agree: the number is not what one process computes; a "
            "value from rank 0's part of the data alone (a metric not reduced over ranks) "
            "prints so; reduce (sum, count) over ranks (rt.evaluate, ddpkit.engines.comm.reduce)",
            [f"printed on 1 process (twice alike): {line_one!r}",
             f"printed by rank 0 of {many.world_size}: {line_many!r}"])


def printed_notes(one: RunRecord, many: RunRecord, again: Optional[RunRecord],
                  band: float = 1e-6) -> List[str]:
    """A note for a PASS: the first number rank 0 prints in training (not after an evaluation)
    that differs from 1 process's as :func:`printed_differs` compares them (a loss of rank
    0's batch alone, say).

    Example::

        printed_notes(one, many, again)   # ["rank 0 prints 'loss 0.1090' where ..."]
    """
    found = _first_difference("late_prints", one, many, again, band)
    if found is None:
        return []
    line_one, line_many, a, b = found
    return [f"rank 0 prints {line_many!r} where 1 process prints {line_one!r} ({b:g} against "
            f"{a:g}): a number from rank 0's part of the batch; rt.mean(...) prints the whole "
            "batch's"]


def _first_difference(kind: str, one: RunRecord, many: RunRecord, again: Optional[RunRecord],
                      band: float) -> Optional[Tuple[str, str, float, float]]:
    """The first pair of lines (1 process, rank 0 of N) of the same print (among ``kind``:
    ``late_prints`` or ``eval_prints``) whose numbers differ, among numbers that 1 process
    printed alike twice, where both runs' models still agreed."""
    lines_one, lines_many = getattr(one, kind), getattr(many, kind)
    if again is None or not lines_one or not lines_many or not again.late_prints:
        return None
    if accumulated(one):  # the loop's last loss is a micro-batch's: no number of the script's
        return None
    repeat = dict(_pairs(one.late_prints[0], again.late_prints[0]))
    for line_one, line_many in _pairs(lines_one[0], lines_many[0]):
        line_again = repeat.get(line_one)
        if line_again is None or _models_parted(one, many, line_one, line_many):
            continue
        texts = [m.group(0) for m in _NUMBER.finditer(line_one)]
        for text, (a, da), (r, dr), (b, db) in zip(texts, numbers(line_one),
                                                  numbers(line_again), numbers(line_many)):
            if not _is_float(text) or abs(a - r) > da + dr:
                continue
            if abs(b - a) > da + db + max(band, 1e-5) * max(abs(a), abs(b)):
                return line_one.strip(), line_many.strip(), a, b
    return None


def accumulated(one: RunRecord) -> int:
    """The micro-batches a step of the 1-process run accumulated where the script wrote one
    batch a step (``--accum-steps``, BatchNorm's default): then what its loop holds at a print
    (the last loss, a running sum) is a micro-batch's, and printed numbers are not compared.

    Example::

        accumulated(one)   # 2
    """
    micro = max((loader.get("micro_steps") or 1 for loader in one.loaders), default=1)
    return micro if micro > 1 else 0


def _models_parted(one: RunRecord, many: RunRecord, line_one: str, line_many: str) -> bool:
    """Whether the two runs' models had parted where these lines were printed (after the steps
    compared: an epoch's padded last batch, float noise grown over many steps), or cannot be
    told (sharded): what such lines print may differ for that alone."""
    if line_one not in one.print_models or line_many not in many.print_models:
        return False  # not recorded (records made by hand)
    a, b = one.print_models[line_one], many.print_models[line_many]
    if a is None or b is None or len(a) != len(b):
        return True
    scale = max(max((abs(x) for x in a), default=0.0), 1e-30)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0) > 1e-5 * scale
