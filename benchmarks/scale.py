"""GPT-3 175B on 1024 H100s, planned on this machine: how long the compile takes, and our
plan beside Megatron-LM's published one, both predicted by the same simulator.

Each row is one `python -m partitioner compile examples/gpt3_175b.py --analytic
--hardware h100 --memory 80GiB ...` run as its own process (wall time from start to exit,
Python's start-up and imports included):

- ours: `--devices 1024`, the mesh, microbatch count and recomputation searched;
- Megatron-LM: the mesh of its published GPT-3 175B script
  (examples/gpt3/train_gpt3_175b_distributed.sh: tensor 8, pipeline 16, micro-batch 1,
  global batch 1536, so 8 data-parallel replicas of 192 microbatches), 1F1B as published,
  and with the paper's interleaved schedule (Narayanan et al. 2021, section 2.2) and full
  activation recomputation (section 3.5) for reference.

    python -m benchmarks.scale [--quick] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


from .common import compile_process, rank_peak_bytes, save, table, update_docs

MODEL = "examples/gpt3_175b.py"
HARDWARE = ["--hardware", "h100", "--memory", "80GiB"]
MEGATRON = ["--stages", "16", "--tp", "8", "--dp", "8", "--microbatches", "192"]
#: (plan, options, shown in --quick)
CASES: list[tuple[str, list[str], bool]] = [
    ("ours: --devices 1024", ["--devices", "1024"], True),
    ("Megatron-LM published (1F1B)", MEGATRON + ["--schedule", "1f1b"], True),
    ("Megatron-LM mesh, interleaved x2", MEGATRON + ["--schedule", "interleaved", "--virtual-stages", "2"], False),
    ("Megatron-LM mesh, 1F1B + recompute", MEGATRON + ["--schedule", "1f1b", "--recompute"], False),
]
GIB = 1 << 30


def _compile(out: Path, options: list[str]) -> dict[str, Any]:
    """Run one compile as its own process; its wall time and what the manifest predicts."""
    m, wall, argv = compile_process(MODEL, out, ["--analytic", *options, *HARDWARE, "--quiet"])
    assert m.predicted is not None
    p, peak = m.predicted, rank_peak_bytes(m)
    return {
        "command": "python " + " ".join(argv[1:-1]).replace(str(out), "build/gpt3"),
        "mesh": f"{m.mesh.pp} x {m.mesh.tp} x {m.mesh.dp}",
        "schedule": m.schedule + (f" x{m.virtual_stages}" if m.virtual_stages > 1 else ""),
        "microbatches": m.microbatches,
        "recompute": "yes" if any(s.recompute for s in m.stages) else "no",
        "devices": m.mesh.world,
        "compile_s": wall,
        "step_s": p.step_time_s,
        "mfu_pct": 100 * p.mfu,
        "peak_gib": peak / GIB,
        "fits_80gib": "yes" if peak <= 80 * GIB else "no",
        "tokens_per_s": (m.batch_size or 0) * 2048 / p.step_time_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="our plan and Megatron-LM's published one only")
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true", help="do not rewrite the block in docs/benchmarks.md")
    ns = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, options, quick) in enumerate(CASES):
            if ns.quick and not quick:
                continue
            rows.append({"plan": name, **_compile(Path(tmp) / f"case{k}", options)})
            print(f"{name}: {rows[-1]['compile_s']:.1f} s", file=sys.stderr, flush=True)
    text = table(rows, ["plan", "mesh", "schedule", "microbatches", "recompute", "compile_s", "step_s", "mfu_pct",
                        "peak_gib", "fits_80gib"])
    ours = rows[0]
    text += (f"\n\nmesh = pipeline stages x tensor-parallel x data-parallel. Command: `{ours['command']}` "
             f"({ours['compile_s']:.1f} s on {os.cpu_count()} CPUs, {ours['devices']} devices). Step and MFU are "
             f"predicted (analytic roofline, h100 profile at 60% of peak); MFU counts model FLOPs only "
             f"(6 x parameters x tokens and attention), as Megatron-LM's and PaLM's do; peak_gib is the fullest "
             f"device's weights, gradients, mixed-precision Adam state and activations.")
    print(text)
    save("scale", rows, model=MODEL, hardware="h100", memory_gib=80)
    if not ns.no_docs:
        update_docs("scale", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
