"""The device bench/gpu/run_all.sh runs on: the planner profile it refits and the GPU's
name, tab-separated on one line (the profile empty for a GPU the planner has none of).

    python bench/gpu/device.py [--tiny]

`--tiny` (a dry run on a CPU): the h200 profile, refit at toy sizes.
"""

from __future__ import annotations

import sys

# The planner's published GPU profiles (planning/hardware.py), by a word of the GPU's name.
PROFILES = {"H200": "h200", "H100": "h100"}


def profile_of(name: str) -> str:
    """The planner profile of a GPU named `name` (torch's device name), or ""."""
    return next((p for word, p in PROFILES.items() if word in name.upper()), "")


def main(argv: list[str]) -> int:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        print(f"{profile_of(name)}\t{name}")
    elif "--tiny" in argv:
        print("h200\tno GPU (a dry run on the CPU)")
    else:
        print("\tno GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
