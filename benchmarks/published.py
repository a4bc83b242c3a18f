"""Megatron-LM's weak-scaling table planned with its own mesh: predicted against published TFLOP/s.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), table 1: GPT models of 1.7B to 1T parameters on 32 to 3072 A100-80GB,
sequence 2048, vocabulary 51200, full activation recomputation.  Each row is one `python -m
partitioner compile benchmarks/models/megatron_gpt.py --analytic --hardware a100 --memory
80GiB --precision bf16 --recompute` run as its own process with the row's mesh, schedule
and layers per virtual stage as Megatron-LM's own script for the table ran them
(NVIDIA/Megatron-LM, examples/sc21/run_table_1.sh: interleaved 1F1B with
`--num-layers-per-virtual-pipeline-stage` on the 76B, 145B, 310B and 530B rows, plain 1F1B
elsewhere), one row per microbatch (the script's are 16 rows down to 1: `Row.microbatches`),
and its TFLOP/s per GPU counted as the paper counts them, 96 B s l h^2 (1 + s/6h + V/16lh) per step.
Then the planner's own search for the same GPUs and batch (`--devices`, the mesh, schedule,
microbatches and recomputation its choice): its predicted speedup over the published step,
its plan, its peak memory per rank and the search's wall time.

    python -m benchmarks.published [--rows 0,1,6] [--no-search] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple


from .common import compile_process, rank_peak_bytes, save, table, update_docs

MODEL = "benchmarks/models/megatron_gpt.py"
SEQ, VOCAB, GIB = 2048, 51200, 1 << 30
COMMON = ["--analytic", "--meta", "--hardware", "a100", "--memory", "80GiB", "--precision", "bf16", "--quiet"]
OPTIONS = [*COMMON, "--recompute"]


class Row(NamedTuple):
    params: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    mbs: int  # Megatron-LM's samples per microbatch (--micro-batch-size); planned with one (`microbatches`)
    layers_per_virtual: int  # --num-layers-per-virtual-pipeline-stage; 0: plain 1F1B
    published_tflops: float

    @property
    def schedule(self) -> str:
        return "interleaved" if self.layers_per_virtual else "1f1b"

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank: each rank's layers over the layers of one virtual stage."""
        return self.layers // self.pp // self.layers_per_virtual if self.layers_per_virtual else 1

    @property
    def microbatches(self) -> int:
        """Microbatches per step of each data-parallel replica: one row each, not Megatron-LM's
        `mbs` rows (the runtime's recomputation runs a stage's whole forward again at once, so
        16 rows of the 1.7B model, 64 GiB of activations, do not fit 80 GiB; Megatron-LM's
        recomputes one layer at a time)."""
        return self.batch // (self.gpus // (self.tp * self.pp))


ROWS = [  # NVIDIA/Megatron-LM examples/sc21/run_table_1.sh: TP, PP, MBS, GBS, layers per virtual stage
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 0, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 0, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 0, 142),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 0, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 0, 138),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163),
    Row("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 0, 163),
]


def step_flops(row: Row) -> float:
    """The paper's FLOPs of one step with full recomputation (its equation 3)."""
    b, s, l, h = row.batch, SEQ, row.layers, row.hidden
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def plan(row: Row, out: Path) -> dict[str, Any]:
    """Compile `row` with Megatron-LM's mesh in its own process: what the manifest predicts."""
    dp = row.gpus // (row.tp * row.pp)
    mesh = ["--stages", str(row.pp), "--tp", str(row.tp), "--dp", str(dp), "--microbatches", str(row.microbatches),
            "--schedule", row.schedule, *(["--virtual-stages", str(row.virtual_stages)] if row.layers_per_virtual else [])]
    m, wall, _ = compile_process(MODEL, out, [*mesh, *OPTIONS], _env(row))
    assert m.predicted is not None
    peak = rank_peak_bytes(m)
    predicted = step_flops(row) / (m.predicted.step_time_s * row.gpus) / 1e12
    return {"params": row.params, "mesh": f"{row.tp} x {row.pp} x {dp}", "schedule": _schedule(m),
            "predicted_tflops": predicted, "published_tflops": row.published_tflops,
            "ratio": predicted / row.published_tflops, "peak_gib": peak / GIB, "compile_s": wall,
            "step_s": m.predicted.step_time_s}


def search(row: Row, out: Path) -> dict[str, Any]:
    """The planner's own search for the row's GPUs and batch, in its own process."""
    m, wall, _ = compile_process(MODEL, out, ["--devices", str(row.gpus), *COMMON], _env(row))
    assert m.predicted is not None
    published_step = step_flops(row) / (row.published_tflops * 1e12 * row.gpus)
    return {"search_mesh": f"{m.mesh.tp} x {m.mesh.pp} x {m.mesh.dp}", "search_schedule": _schedule(m),
            "search_microbatches": m.microbatches, "search_recompute": any(s.recompute for s in m.stages),
            "search_step_s": m.predicted.step_time_s, "speedup": published_step / m.predicted.step_time_s,
            "search_peak_gib": rank_peak_bytes(m) / GIB, "search_s": wall}


def _env(row: Row) -> dict[str, str]:
    """The model file's size for `row`."""
    return dict(MEG_H=str(row.hidden), MEG_L=str(row.layers), MEG_HEADS=str(row.heads), MEG_B=str(row.batch),
                MEG_SEQ=str(SEQ), MEG_VOCAB=str(VOCAB))


def _schedule(m: Any) -> str:
    """A manifest's schedule, with its stages per rank where it runs several."""
    return m.schedule + (f" x{m.virtual_stages}" if m.virtual_stages > 1 and m.schedule == "interleaved" else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(str(k) for k in range(len(ROWS))),
                        help="the table's rows to plan, e.g. 0,1,6 (default: all ten)")
    parser.add_argument("--no-docs", dest="no_docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--no-search", dest="no_search", action="store_true", help="plan Megatron-LM's meshes only")
    ns = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in (int(x) for x in ns.rows.split(",")):
            rows.append({"row": k, **plan(ROWS[k], Path(tmp) / f"row{k}")})
            if not ns.no_search:
                rows[-1].update(search(ROWS[k], Path(tmp) / f"search{k}"))
            print(f"row {k}: compile {rows[-1]['compile_s']:.1f} s, search {rows[-1].get('search_s', 0):.1f} s",
                  file=sys.stderr, flush=True)
    text = table(rows, ["row", "params", "mesh", "schedule", "predicted_tflops", "published_tflops", "ratio",
                        "peak_gib", "compile_s"])
    if not ns.no_search:
        text += "\n\n" + table(rows, ["row", "params", "search_mesh", "search_schedule", "search_microbatches",
                                      "search_recompute", "speedup", "search_peak_gib", "search_s"])
    text += (f"\n\nmesh = tp x pp x dp, Megatron-LM's (SC'21, table 1); TFLOP/s per GPU as the paper counts them; "
             f"predicted from the analytic a100 profile with `{' '.join(OPTIONS)}` (less --quiet); compile_s is one "
             f"run on {os.cpu_count()} shared CPUs.  The second table: `--devices` = the row's GPUs, same batch; "
             f"speedup = the published step over the search's predicted step; search_s its wall time.")
    print(text)
    save("published", rows, model=MODEL, hardware="a100", memory_gib=80)
    if not ns.no_docs:
        update_docs("published", text, append=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
