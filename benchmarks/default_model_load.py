"""How long a second load of the default model takes once the libraries are imported.

The first load fetches and converts the GGUF (once per machine); every later load reads
the safetensors copy. Each measurement runs in a fresh process so nothing is warm but
the OS file cache, and times ``load_model`` alone, after the imports it needs.

    python benchmarks/default_model_load.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, time
t0 = time.perf_counter()
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401
from engine.models.loading import LoadRequest, load_model
imports = time.perf_counter() - t0
t1 = time.perf_counter()
loaded = load_model(LoadRequest("default", {precision!r}, "cpu"))
first = time.perf_counter() - t1
t2 = time.perf_counter()
load_model(LoadRequest("default", {precision!r}, "cpu"))
again = time.perf_counter() - t2
print(json.dumps({{"imports_s": imports, "load_s": first, "same_process_again_s": again}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()

    from engine.models import default_model

    default_model.ensure()  # the one-time fetch + conversion is not what we measure
    rows = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD.format(precision=args.precision)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for key in ("imports_s", "load_s", "same_process_again_s"):
        values = [r[key] for r in rows]
        print(f"{key:>22}: " + " ".join(f"{v:5.2f}" for v in values) + f"   median {statistics.median(values):5.2f} s")
    print(f"target: a load after imports < 3 s -> median load {statistics.median(r['load_s'] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
