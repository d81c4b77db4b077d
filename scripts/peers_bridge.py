"""Run the shared peer benchmark (peers.py) with two more providers: cupyln through its torch
bridge, as a torch user calls it.

    python scripts/peers_bridge.py path/to/peers.py tutorial      # or large | odd | all

peers.py reaches cupyln through the core API on DLPack views it makes on every call (three
``cupy.from_dlpack`` and three ``torch.from_dlpack``), tens of microseconds of CPU that its
shortest shapes cannot hide. This loads the script unchanged, adds the providers
``cupyln.torch`` (``cupyln.torch.forward`` / ``backward``: the same kernels on the same torch
tensors, launched on torch's stream) and ``cupyln.torch.ops`` (``torch.ops.cupyln.norm_fwd``
/ ``norm_bwd``, the ops torch.compile puts in its graphs: the same work behind torch's
dispatcher) and runs the script's own ``main``, so every provider is timed and checked the same
way in one process. Run it from the project root, as peers.py asks.
"""

import importlib.util
import os
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    sys.path.insert(0, os.getcwd())  # this checkout's cupyln, as peers.py imports it
    spec = importlib.util.spec_from_file_location("peers", path)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)

    import torch

    import cupyln.torch as clt  # also registers torch.ops.cupyln

    ops = torch.ops.cupyln

    def forward(x, w, b, eps):
        return clt.forward(x, w, b, eps)

    def backward(dy, x, w, b, mean, rstd, eps):
        return clt.backward(dy, x, w, mean, rstd)

    def op_forward(x, w, b, eps):
        return ops.norm_fwd(x, None, w, b, eps, False, None, 0.0)[:3]

    def op_backward(dy, x, w, b, mean, rstd, eps):
        return ops.norm_bwd(dy, None, x, w, mean, rstd, False, 0.0)

    peers.PROVIDERS["cupyln.torch"] = (forward, backward)
    peers.PROVIDERS["cupyln.torch.ops"] = (op_forward, op_backward)
    sys.argv = [path, *sys.argv[2:]]
    peers.main()


if __name__ == "__main__":
    main()
