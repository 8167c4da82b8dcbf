"""The summary of bench/gpu/run_all.sh: `$OUT/summary.json`, one object per stage (status,
the GPU it ran on, seconds, limit, figures), and the same as a table in `$OUT/summary.txt`.

    python bench/gpu/summary.py record OUT WORK NAME STATUS SECONDS LIMIT GPU [key=value ...]
    python bench/gpu/summary.py table OUT

`record` adds stage NAME (replacing an earlier record of it): its figures are the
`key=value` pairs given (values read as JSON where they parse), `WORK/NAME.json` when the
stage wrote one, and each `WORK/NAME.<part>.json` under the key `<part>`. Standard library
only: it runs before anything is installed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The figures the table shows, in this order, where a stage has them.
SHOWN = (("tokens_per_s", "tok/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}"),
         ("peak_memory_gb", "peak GB", "{:.1f}"), ("step_ms", "step ms", "{:,.1f}"),
         ("loss_first", "loss from", "{:.3f}"), ("loss_last", "to", "{:.3f}"))


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def figures(work: Path, name: str, pairs: list[str]) -> dict:
    found = {}
    own = work / f"{name}.json"
    if own.is_file():
        found.update(json.loads(own.read_text()))
    for part in sorted(work.glob(f"{name}.*.json")):
        found[part.name[len(name) + 1:-len(".json")]] = json.loads(part.read_text())
    for pair in pairs:
        key, _, value = pair.partition("=")
        found[key] = _value(value)
    return found


def record(out: Path, work: Path, name: str, status: str, seconds: float, limit: float,
           gpu: str, pairs: list[str]) -> dict:
    path = out / "summary.json"
    stages = json.loads(path.read_text()) if path.is_file() else []
    entry = {"name": name, "status": status, "gpu": gpu, "seconds": seconds,
             "limit_s": limit, "figures": figures(work, name, pairs)}
    stages = [s for s in stages if s["name"] != name] + [entry]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stages, indent=1) + "\n")
    os.replace(tmp, path)
    return entry


def _cells(figures_of: dict) -> list[str]:
    return [fmt.format(figures_of[key]) if isinstance(figures_of.get(key), (int, float))
            else "" for key, _, fmt in SHOWN]


def table(out: Path) -> str:
    stages = json.loads((out / "summary.json").read_text())
    gpus = sorted({s.get("gpu", "") for s in stages})
    head = ["stage", "status", "s", "limit", *(label for _, label, _ in SHOWN)]
    rows = []
    for s in stages:
        parts = {k: v for k, v in s["figures"].items() if isinstance(v, dict)
                 and any(key in v for key, _, _ in SHOWN)}
        rows.append([s["name"], s["status"], f"{s['seconds']:.0f}", f"{s['limit_s']:.0f}",
                     *_cells(s["figures"])])
        rows += [[f"  {part}", "", "", "", *_cells(f)] for part, f in parts.items()]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return f"on {', '.join(gpus)}\n" + "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"] and len(argv) >= 8:
        out, work, name, status, seconds, limit, gpu = argv[1:8]
        record(Path(out), Path(work), name, status, float(seconds), float(limit), gpu,
               argv[8:])
        return 0
    if argv[:1] == ["table"] and len(argv) == 2:
        text = table(Path(argv[1]))
        (Path(argv[1]) / "summary.txt").write_text(text)
        print(text, end="")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
