"""Execute the notebooks top to bottom on this machine (a GPU one) and write the executed
copies, outputs and figures included, to a folder (default: in place).
    python scripts/run_notebooks.py [OUT_DIR]"""

import sys
import time
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        t = time.time()
        nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()  # fmt: skip
        nbformat.write(nb, out / path.name)
        print(f"{path.name}: executed in {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "notebooks")
