"""A torchrun rank: writes how it started (what torchrun and a new interpreter gave it), then
exits with the code it is given (`sys.exit(main())`, as the workers do).

    rank_start.py OUT (done | EXIT_CODE)
"""

import io
import json
import os
import signal
import sys

import torch


def main():
    report = {
        "name": __name__,
        "path0": sys.path[0],
        "signals": {s.name: repr(signal.getsignal(s)) for s in
                    (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)},
        "threads": torch.get_num_threads(),
        "unbuffered": [isinstance(s.buffer, io.FileIO) or s.write_through
                       for s in (sys.stdout, sys.stderr)],
    }
    with open(f"{sys.argv[1]}.{os.environ['RANK']}", "w") as f:
        json.dump(report, f)
    print(f"rank {os.environ['RANK']} started")
    return None if sys.argv[2] == "done" else int(sys.argv[2])


if __name__ == "__main__":
    sys.exit(main())
