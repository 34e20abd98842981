#!/usr/bin/env python3
"""exact_reuse: how often a thread cache could hand a trace's allocations their blocks back
without changing where PyTorch's rules put them.

A replay of a training trace goes through mempool's locked path at almost every event (the
thread caches see too few blocks come back: their hit-rate window sends frees past them), so
warm replays cost best fit, split and merge per event. This measures the two ceilings of a
cache in front of those rules, on PyTorch's native placement (sizes rounded to 512 B; requests
of at most 1 MiB from 2 MiB segments, below 10 MiB from 20 MiB segments, larger ones from
their own segments rounded to 2 MiB; best fit by (size, address) per kind; a small block split
when 512 B or more remain, a large one when more than 1 MiB remains; neighbours merged on
free; one stream; segments never given back), three reps of each trace on what the reps
before left:

- `same_size`: a cache of every freed block by requested size, unbounded, that ignores
  placement: a hit whenever a block of that size was freed and not taken again. What a
  segregated cache would reach, at the price of PyTorch's placement and peaks.
- `exact`: a hit only where best fit on the true state (every freed block filed and merged)
  returns, unsplit, a block freed as itself (not merged) since the last miss of its kind; a
  miss files everything cached of its kind (best fit must see the true state). What a cache
  that keeps PyTorch's placement block for block can reach, at most.

    python3 mempool-bench/harness/exact_reuse.py traces/*.trace

Prints per trace and rep: `<trace> rep=<r> allocs=<n> same_size=<hits> (<%>) exact=<hits> (<%>)`.
Standard library only.
"""
import bisect
import collections
import sys

MIB = 1 << 20


def rounded(n):
    return 512 if n < 512 else (n + 511) // 512 * 512


class Block:
    __slots__ = ("addr", "size", "prev", "next", "free", "small")


def segment_size(r, small):
    if small:
        return 2 * MIB
    if r < 10 * MIB:
        return 20 * MIB
    return (r + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)


def replay(path, reps=3):
    events = [line.split() for line in open(path) if line.strip()]
    free_sets = {True: [], False: []}  # sorted (size, addr, id) per kind
    by_id = {}
    live = {}
    top = [0]
    cached = {True: {}, False: {}}  # addr -> block freed unmerged since the kind's last miss
    size_of = {}
    same = collections.Counter()  # requested size -> blocks freed and not taken again

    def insert(b):
        bisect.insort(free_sets[b.small], (b.size, b.addr, id(b)))
        by_id[id(b)] = b

    def remove(b):
        s = free_sets[b.small]
        i = bisect.bisect_left(s, (b.size, b.addr, id(b)))
        assert s[i][2] == id(b)
        s.pop(i)

    out = []
    for rep in range(reps):
        allocs = exact = same_hits = 0
        for e in events:
            if e[0] == "a":
                allocs += 1
                requested = int(e[2])
                size_of[e[1]] = requested
                if same[requested] > 0:
                    same[requested] -= 1
                    same_hits += 1
                r = rounded(requested)
                small = r <= MIB
                s = free_sets[small]
                i = bisect.bisect_left(s, (r, -1, -1))
                if i < len(s):
                    b = by_id[s.pop(i)[2]]
                else:
                    b = Block()
                    b.addr, b.size, b.prev, b.next, b.small, b.free = top[0], segment_size(r, small), None, None, small, True
                    top[0] += b.size + (1 << 30)
                rest = b.size - r
                split = rest >= 512 if small else rest > MIB
                c = cached[small]
                if not split and b.size == r and c.get(b.addr) is b:
                    exact += 1
                    del c[b.addr]
                else:
                    c.clear()
                if split:
                    n = Block()
                    n.addr, n.size, n.prev, n.next, n.small, n.free = b.addr + r, rest, b, b.next, small, True
                    if b.next:
                        b.next.prev = n
                    b.next = n
                    b.size = r
                    insert(n)
                b.free = False
                live[e[1]] = b
            else:
                same[size_of[e[1]]] += 1
                b = live.pop(e[1])
                b.free = True
                merged = False
                if b.prev and b.prev.free:
                    p = b.prev
                    remove(p)
                    cached[b.small].pop(p.addr, None)
                    p.size += b.size
                    p.next = b.next
                    if b.next:
                        b.next.prev = p
                    b, merged = p, True
                if b.next and b.next.free:
                    n = b.next
                    remove(n)
                    cached[b.small].pop(n.addr, None)
                    b.size += n.size
                    b.next = n.next
                    if n.next:
                        n.next.prev = b
                    merged = True
                insert(b)
                if not merged:
                    cached[b.small][b.addr] = b
        name = path.rsplit("/", 1)[-1]
        out.append(
            f"{name} rep={rep} allocs={allocs} same_size={same_hits} ({100 * same_hits / allocs:.0f}%) "
            f"exact={exact} ({100 * exact / allocs:.0f}%)"
        )
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: exact_reuse.py TRACE...")
    for p in sys.argv[1:]:
        print("\n".join(replay(p)))
