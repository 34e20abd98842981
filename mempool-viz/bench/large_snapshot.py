"""Writes a PyTorch-layout snapshot with N trace entries (default 1,000,000) for timing
mempool-viz on large traces: alloc/free pairs of varied sizes on two pools, 40 distinct
stacks of 30 frames shared between entries (as PyTorch shares them), segments at the end.

    python3 large_snapshot.py OUT.pickle [N]
"""
import pickle
import random
import sys

out = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
random.seed(7)
stacks = []
for s in range(40):
    stacks.append([{"name": f"fn_{s}_{d}", "filename": f"/src/model_{s % 7}.py", "line": 10 + d} for d in range(30)])
entries = []
live = []
t = 1_700_000_000_000_000
addr = 0x7F0000000000
seg_size = 1 << 30
entries.append({"action": "segment_alloc", "addr": addr, "size": seg_size, "stream": 0, "time_us": t, "frames": []})
cursor = addr
while len(entries) < n:
    t += random.randint(1, 50)
    if live and (len(live) > 500 or random.random() < 0.5):
        a, size, st = live.pop(random.randrange(len(live)))
        entries.append({"action": "free_requested", "addr": a, "size": size, "stream": 0, "time_us": t, "frames": st})
        entries.append({"action": "free_completed", "addr": a, "size": size, "stream": 0, "time_us": t, "frames": st})
    else:
        size = random.choice([512, 4096, 65536, 1 << 20, 3 << 20])
        st = stacks[random.randrange(len(stacks))]
        a = cursor
        cursor += size
        if cursor >= addr + seg_size:
            cursor = addr
        live.append((a, size, st))
        entries.append({"action": "alloc", "addr": a, "size": size, "stream": 0, "time_us": t, "frames": st})
live_bytes = sum(s for _, s, _ in live)
blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated", "frames": st} for a, s, st in sorted(live)]
blocks.append({"address": addr + live_bytes, "size": seg_size - live_bytes, "requested_size": 0, "state": "inactive", "frames": []})
segment = {"device": 0, "address": addr, "total_size": seg_size, "allocated_size": live_bytes, "active_size": live_bytes,
           "requested_size": live_bytes, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
           "is_expandable": False, "frames": [], "blocks": blocks}
with open(out, "wb") as f:
    pickle.dump({"segments": [segment], "device_traces": [entries], "allocator_settings": {}}, f, protocol=4)
print(out, len(entries), "entries")
