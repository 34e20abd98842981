#!/usr/bin/env python3
"""trace_fuzz.py DIR SEED COUNT: writes COUNT random traces into DIR (f00000.trace, ...), for
`compare.sh --self-test` to read with both trace_check and `mempool-bench replay --backend sim`:
the two readers must accept the same traces and refuse the others at the same line with the same
message. Half are near-valid sequences (ids reused, freed twice, allocated while live, several
streams); half are lines of random words, numbers at and past each field's bounds, Unicode blanks,
control characters and, now and then, bytes that are not UTF-8. No allocation is above 1 GiB, so
that every accepted trace also replays on the sim backend.
"""
import os
import random
import sys

BLANKS = [" ", " ", " ", "\t", "  ", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c", "\r", "\u0085"]
WORDS = ["0", "1", "7", "42", "007", "512", "4096", "1099511627777", "18446744073709551615",
         "18446744073709551616", "9223372036854775807", "9223372036854775808", "99999999999999999999",
         "-1", "-0", "-", "+5", "0x7f", "1.5", "x", "\x01", '"q"', "a\\b", "\x7f", "\x00", "1e3"]
EVENTS = ["a", "a", "a", "f", "f", "A", "alloc", "b", "#", '"', "\x02"]


def wordy_line(rnd):
    if rnd.random() < 0.05:
        return ""
    if rnd.random() < 0.03:
        return rnd.choice(BLANKS)
    event = rnd.choice(EVENTS)
    words = [event]
    for i in range(rnd.choice([0, 1, 2, 3, 3, 3, 4, 5]) if event == "a" else rnd.choice([0, 1, 1, 1, 2])):
        if rnd.random() < 0.8:
            words.append(str(rnd.randrange(6)) if i == 0 else rnd.choice(["512", "4096", "1"]) if i == 1 else rnd.choice(["0", "3"]))
        else:
            words.append(rnd.choice(WORDS))
    line = "".join(w + (rnd.choice(BLANKS) if i + 1 < len(words) else "") for i, w in enumerate(words))
    if rnd.random() < 0.1:
        line = rnd.choice(BLANKS) + line
    if rnd.random() < 0.1:
        line += rnd.choice(BLANKS)
    return line


def wordy(rnd):
    end = rnd.choice(["\n", "\r\n"])
    data = (end.join(wordy_line(rnd) for _ in range(rnd.randrange(1, 12))) + end * (rnd.random() < 0.8)).encode()
    if rnd.random() < 0.03:
        data += rnd.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80"])  # not UTF-8: a bad byte, overlong, surrogate
    return data


def sequence(rnd):
    live, dead, lines = set(), set(), []
    for _ in range(rnd.randrange(1, 60)):
        r = rnd.random()
        if r < 0.02:
            lines.append("f %d" % rnd.choice(sorted(dead) or [99]))
        elif r < 0.04:
            lines.append("a %d 8" % rnd.choice(sorted(live) or [98]))
        elif r < 0.05:
            lines.append("f 77")
        elif r < 0.08:
            lines.append("")
        elif live and r < 0.5:
            i = rnd.choice(sorted(live))
            live.discard(i)
            dead.add(i)
            lines.append("f %d" % i)
        else:
            i = rnd.choice([x for x in list(range(40)) + [2**64 - 1] if x not in live])
            live.add(i)
            dead.discard(i)
            stream = rnd.choice(["", " 0", " 0", " 5", " 140000", " 9223372036854775807"])
            lines.append("a %d %d%s" % (i, rnd.choice([1, 512, 4096, 1 << 20, 3 << 20, 1 << 30]), stream))
    return ("\n".join(lines) + "\n").encode()


def main(out, seed, count):
    rnd = random.Random(seed)
    for n in range(count):
        with open(os.path.join(out, "f%05d.trace" % n), "wb") as f:
            f.write(sequence(rnd) if n % 2 else wordy(rnd))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
