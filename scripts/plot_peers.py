"""Plot a run of the shared peer benchmark: GB/s against N, one line per provider.

    python scripts/plot_peers.py docs/peers_h200_large.json out.png

Takes the JSON that peers.py (or scripts/peers_bridge.py) writes, whose rows hold one entry a
provider, and draws it with cupyln.bench's figure (forward and backward side by side, the copy
bandwidth of the same run as a dashed ceiling). Meant for the sets of one M or one M·N
(``large``, ``tutorial``); ``odd`` mixes shapes and dtypes.
"""

import json
import os
import sys


def rows_by_provider(rows: list[dict]) -> list[dict]:
    """peers.py's rows (one a shape, a dict a provider) as cupyln.bench's rows (one a
    provider and shape)."""
    out = []
    for r in rows:
        for provider, v in r.items():
            if isinstance(v, dict) and "fwd_GBs" in v:
                out.append({"provider": provider, "N": r["N"], "fwd_GBs": v["fwd_GBs"],
                            "bwd_GBs": v.get("bwd_GBs")})  # fmt: skip
    return out


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.path.insert(0, os.getcwd())
    from cupyln import bench

    with open(sys.argv[1]) as f:
        run = json.load(f)
    first = run["rows"][0]
    title = f"({first['tag']}, {first['dtype']}, {run['device']})"
    bench.plot(rows_by_provider(run["rows"]), sys.argv[2], run["copy_GBs"], title)


if __name__ == "__main__":
    main()
