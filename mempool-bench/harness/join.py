#!/usr/bin/env python3
"""Joins the harnesses' lines with mempool-bench's and prints one table per workload.

    join.py latency MEMPOOL_FILE OTHER_FILE...   mempool-bench `latency` lines (`pair <bytes> <ns>`,
                                                 `mixed <live> <ns>`) against the harness's
                                                 (`<system> pair <bytes> <ns>`, ...)
    join.py replay FILE...                       replay lines of every system, mempool's included:
                                                 `<system> <trace> rep=<r> <cold|warm> events=<n>
                                                 ns_per_event=<x> peak_allocated=<b> peak_reserved=<b>`
    join.py allreduce MEMPOOL_FILE TORCH_FILE    the `allreduce` example's table (`MiB | reg_us reg_algbw
                                                 reg_busbw | win_us win_busbw | def_us def_algbw
                                                 def_busbw`) against torch_allreduce.py's lines
                                                 (`torch allreduce <MiB> default_us <x> default_busbw
                                                 <y> reg_us <x> reg_busbw <y>`)

speedup = other_ns / mempool_ns (above 1: mempool is faster); peak ratios = other / mempool
(above 1: the other holds more); all-reduce: reg_x = mempool's registered busbw / torch's
registered-pool busbw (above 1: mempool is faster). Lines of any other shape (`#` notes, mempool-bench's `pair-raw`
rows, messages) are skipped; a row seen twice, or a row of the right shape with a field that is not
a number, is an error. Exit status 1 when the systems replayed different event counts of a trace
or when a row has no mempool row to compare with, and when the all-reduce sides do not cover the
same sizes, lack torch's registered-pool figures or ran on different numbers of GPUs; 2 on bad input.
Standard library only (python3), so it runs where compare.sh runs.
"""
import re
import sys


class BadInput(Exception):
    pass


def rows_of(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            yield "%s:%d" % (path, n), line.split()


def number(where, word, kind=float):
    try:
        return kind(word)
    except ValueError:
        raise BadInput("%s: %r is not a number" % (where, word)) from None


def put(table, key, value, where):
    if key in table:
        raise BadInput("%s: a second row for %s (one run per file)" % (where, " ".join(map(str, key))))
    table[key] = value


def fmt_ratio(x, places=2, suffix="x"):
    return "-" if x is None else "%.*f%s" % (places, x, suffix)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def print_table(header, rows, words=1):
    """The first `words` columns left-aligned, the numbers after them right-aligned."""
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) if i < words else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())


# Columns and rows in this order, then any other system in the order it came.
SYSTEMS = ["mempool", "torch", "torch_expand", "cuda_async", "cuda_malloc"]


def in_order(systems):
    return sorted(systems, key=lambda s: SYSTEMS.index(s) if s in SYSTEMS else len(SYSTEMS))


def latency(mempool_file, other_files):
    mine, other, systems, order = {}, {}, [], []
    for where, w in rows_of(mempool_file):
        if len(w) == 3 and w[0] in ("pair", "mixed"):
            key = (w[0], number(where, w[1], int))
            put(mine, key, number(where, w[2]), where)
            order.append(key)
    for path in other_files:
        for where, w in rows_of(path):
            if len(w) == 4 and w[1] in ("pair", "mixed") and not w[0].startswith("#"):
                key = (w[1], number(where, w[2], int))
                put(other, (w[0],) + key, number(where, w[3]), where)
                if w[0] not in systems:
                    systems.append(w[0])
                if key not in order:
                    order.append(key)
    systems = in_order(systems)
    header = ["workload", "mempool_ns"]
    for s in systems:
        header += [s + "_ns", "speedup"]
    rows, worst, missing = [], {}, False
    for key in order:
        m = mine.get(key)
        missing |= m is None
        row = ["%s %d" % key, "-" if m is None else "%.1f" % m]
        for s in systems:
            o = other.get((s,) + key)
            sp = ratio(o, m)
            row += ["-" if o is None else "%.1f" % o, fmt_ratio(sp)]
            if sp is not None:
                worst.setdefault(s, {})
                worst[s][key[0]] = min(worst[s].get(key[0], sp), sp)
        rows.append(row)
    print("latency: ns per pair (pair) or per free + alloc step (mixed); speedup = other_ns / mempool_ns")
    print_table(header, rows)
    for s in systems:
        kinds = ", ".join("%s %.2fx" % (k, v) for k, v in worst.get(s, {}).items())
        print("min speedup vs %s: %s" % (s, kinds or "-"))
    if missing:
        print("! rows without a mempool figure: is %s mempool-bench's `latency` output?" % mempool_file)
    return 1 if missing else 0


REPLAY = re.compile(
    r"^(\S+) (\S+) rep=(\d+) (cold|warm) events=(\d+) ns_per_event=(\S+) peak_allocated=(-?\d+) peak_reserved=(-?\d+)$"
)


def replay(files):
    runs, traces, systems = {}, [], []
    for path in files:
        for where, w in rows_of(path):
            if len(w) < 3 or not w[2].startswith("rep="):
                continue
            m = REPLAY.match(" ".join(w))
            if not m:
                raise BadInput("%s: not a replay line: %s" % (where, " ".join(w)))
            system, trace, rep, state, events, ns, alloc, reserved = m.groups()
            value = (state, int(events), number(where, ns), int(alloc), int(reserved))
            put(runs, (trace, int(rep), system), value, where)
            if trace not in traces:
                traces.append(trace)
            if system not in systems:
                systems.append(system)
    systems = in_order(systems)
    status = 0
    for i, trace in enumerate(traces):
        reps = sorted({r for (t, r, _) in runs if t == trace})
        events = {runs[k][1] for k in runs if k[0] == trace}
        if i:
            print()
        print(
            "replay %s (%s events): speedup = other_ns / mempool_ns; alloc_x, reserved_x = other peak / mempool peak"
            % (trace, "/".join(str(e) for e in sorted(events)))
        )
        header = ["rep", "state", "system", "ns_per_event", "speedup", "peak_allocated", "peak_reserved", "alloc_x", "reserved_x"]
        rows = []
        for rep in reps:
            mine = runs.get((trace, rep, "mempool"))
            for s in systems:
                r = runs.get((trace, rep, s))
                if r is None:
                    continue
                state, _, ns, alloc, reserved = r
                same = s == "mempool"
                rows.append([
                    str(rep), state, s, "%.1f" % ns,
                    "" if same else fmt_ratio(ratio(ns, mine and mine[2])),
                    str(alloc), str(reserved),
                    "" if same else fmt_ratio(ratio(alloc, mine and mine[3]), 3, ""),
                    "" if same else fmt_ratio(ratio(reserved, mine and mine[4]), 3, ""),
                ])
            if mine is None:
                status = 1
        print_table(header, rows, words=3)
        if len(events) > 1:
            print("! the systems replayed different numbers of events: they did not read the same trace")
            status = 1
        if any((trace, rep, "mempool") not in runs for rep in reps):
            print("! no mempool rows for some reps of this trace")
            status = 1
    return status


def busbw(where, word):
    """A bus bandwidth figure, or None for `-` (a column that was not measured)."""
    return None if word == "-" else number(where, word)


def fmt_gbs(x):
    return "-" if x is None else "%.1f" % x


def allreduce(mempool_file, torch_file):
    mine, theirs, world, about = {}, {}, {}, {}
    for where, w in rows_of(mempool_file):
        if w[:2] == ["#", "allreduce:"] and len(w) > 2:
            world["mempool"] = number(where, w[2], int)
            about["mempool"] = " ".join(w[2:])
        elif len(w) > 1 and w[1] == "|" and w[0].isdigit():
            # MiB | reg_us reg_algbw reg_busbw | win_us win_busbw | def_us def_algbw def_busbw
            if len(w) != 12 or (w[5], w[8]) != ("|", "|"):
                raise BadInput("%s: not a row of the allreduce example's table: %s" % (where, " ".join(w)))
            put(mine, (number(where, w[0], int),), (busbw(where, w[4]), busbw(where, w[11]), busbw(where, w[7])), where)
    for where, w in rows_of(torch_file):
        if w[:3] == ["#", "torch", "allreduce:"] and w[3:4] == ["world"] and len(w) > 4:
            world["torch"] = number(where, w[4].rstrip(","), int)
            about["torch"] = " ".join(w[3:])
        elif w[:2] == ["torch", "allreduce"]:
            if len(w) != 11 or w[3:10:2] != ["default_us", "default_busbw", "reg_us", "reg_busbw"]:
                raise BadInput("%s: not a torch_allreduce.py line: %s" % (where, " ".join(w)))
            put(theirs, (number(where, w[2], int),), (busbw(where, w[6]), busbw(where, w[10])), where)
    print("allreduce: bus bandwidth, GB/s (busbw = algbw * 2(n-1)/n), float32 sum in place; "
          "reg_x = mempool_reg / torch_reg (above 1: mempool is faster)")
    for side in ("mempool", "torch"):
        if side in about:
            print("%-8s %s" % (side + ":", about[side]))
    header = ["MiB", "mempool_reg", "mempool_def", "mempool_win", "torch_def", "torch_reg", "reg_x"]
    rows, ratios = [], []
    for (mb,) in sorted(set(mine) | set(theirs)):
        reg, default, win = mine.get((mb,), (None, None, None))
        t_default, t_reg = theirs.get((mb,), (None, None))
        x = ratio(reg, t_reg)
        if x is not None:
            ratios.append((x, mb))
        rows.append([str(mb), fmt_gbs(reg), fmt_gbs(default), fmt_gbs(win), fmt_gbs(t_default), fmt_gbs(t_reg), fmt_ratio(x)])
    print_table(header, rows, words=0)
    if ratios:
        x, mb = min(ratios)
        print("min reg_x: %.2fx at %d MiB" % (x, mb))
    status = 0
    for side, have, other in (("mempool", mine, theirs), ("torch", theirs, mine)):
        lacking = sorted(mb for (mb,) in other if (mb,) not in have)
        if lacking or not have:
            print("! sizes without a %s row: %s" % (side, ", ".join(map(str, lacking)) or "all (no rows read)"))
            status = 1
    if any(r[1] is None for r in theirs.values()):
        print("! no torch registered-pool figure at some sizes (torch_allreduce.py's note says why)")
        status = 1
    if len(set(world.values())) > 1:
        print("! the sides ran on different numbers of GPUs: mempool %d, torch %d" % (world["mempool"], world["torch"]))
        status = 1
    return status


def main(argv):
    try:
        if len(argv) >= 3 and argv[1] == "latency":
            return latency(argv[2], argv[3:])
        if len(argv) >= 3 and argv[1] == "replay":
            return replay(argv[2:])
        if len(argv) == 4 and argv[1] == "allreduce":
            return allreduce(argv[2], argv[3])
    except (BadInput, OSError) as e:
        print("join.py: %s" % e, file=sys.stderr)
        return 2
    print("usage:\n" + __doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
