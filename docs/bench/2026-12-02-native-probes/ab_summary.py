import sys, json, statistics
import numpy as np
rows = {}
for line in open(sys.argv[1]):
    b, js = line.split(' ', 1); d = json.loads(js)
    for k, v in d.items():
        rows.setdefault((b, k), []).append(v)
NAMES = sorted({b for b, _ in rows})
lo = np.array(rows[(NAMES[0], 'logits')][0])
print('max |logits - first build| (adapter):', [abs(np.array(rows[(b, 'logits')][0]) - lo).max() for b in NAMES])
Rs = sorted({int(k[1][4:]) for k in rows if k[1].startswith('base')})
for R in Rs:
    line = f"rows {R:2d}:"
    for b in NAMES:
        base = statistics.median(sum(rows[(b, f'base{R}')], []))
        per = [statistics.median(x) for x in rows[(b, f'diff{R}')]]
        line += f" | {b} base {base:.2f} lora +{statistics.median(per):.2f} (per process {min(per):.2f}..{max(per):.2f})"
    print(line)
