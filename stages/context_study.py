"""context_study: the context-extension study, compared with the published findings.

Reads the variants the extend_context stage wrote (their meta.json) and their perplexities from the
eval_perplexity stage (the same split at L, 2L, 4L, 8L, ...; per-position buckets in the longest
windows), and writes:

    study.md, study.json       perplexity of every method (zero-shot and fine-tuned, and the direct
                               fine-tune without scaling) at every evaluated length, perplexity by
                               position in the longest windows, and the findings table: each row a
                               published finding, the figure measured here, and whether it holds
    results.json               the findings as rows of the pipeline's report
    figures.json               perplexity per method and length; findings, and how many hold
    metrics.json               findings, and how many hold (DVC metrics)
    table.csv                  method, finetuned, length, perplexity (long format, for pandas)
    plots/perplexity_vs_length.png, plots/perplexity_by_position.png

Findings (Chen et al. 2023, Position Interpolation; Peng et al. 2023, YaRN) are checked in shape at
tiny scale; the thresholds are in params (context_study section).

Run:
    python -m stages.context_study --extend data/extend_context --eval data/eval_perplexity/extend_context \\
        --output data/context_study
    snakemake --cores all context_study       # or: dvc repro context_study
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from stages.common import atomic, config, digest, environment, stage
from stages.common.tracking import runs

STAGE = "context_study"
PI = "Chen et al. 2023 (Position Interpolation)"
YARN = "Peng et al. 2023 (YaRN)"


@dataclass(frozen=True)
class Config:
    unscaled_growth: float
    finetuned_tolerance: float

    def __post_init__(self):
        if self.unscaled_growth < 1 or not 0 <= self.finetuned_tolerance < 1:
            raise ValueError("unscaled_growth must be >= 1 and finetuned_tolerance in [0, 1)")


def load_inputs(extend: Path, evaluated: Path) -> tuple[dict, dict]:
    for path in (extend / "meta.json", evaluated / "figures.json"):
        if not path.is_file():
            raise config.UserError(f"context_study: {path} not found; run the stage that writes it first")
    meta = json.loads((extend / "meta.json").read_text())
    meta["variants"] = {name: meta["variants"][name] for name in meta.get("order", meta["variants"])}
    metrics = json.loads((evaluated / "figures.json").read_text())["models"]
    missing = sorted(set(meta["variants"]) - set(metrics))
    if missing:
        raise config.UserError(
            f"context_study: {evaluated}/figures.json lacks variant {missing[0]}; evaluate "
            f"{extend}/model with eval_perplexity (it evaluates every subfolder)"
        )
    return meta, metrics


def perplexity_table(meta: dict, metrics: dict) -> tuple[list[int], dict]:
    """Lengths evaluated (>= L) and {variant: {length: perplexity}}; L and s x L must be among them."""
    L, E = meta["original_context"], meta["extended_context"]
    lengths = sorted({int(k.removeprefix("ctx")) for m in metrics.values() for k in m})
    for need in (L, E):
        if need not in lengths:
            raise config.UserError(
                f"context_study: the variants were not evaluated at context {need} (L = {L}, "
                f"s x L = {E}); set eval_perplexity.contexts to include them, e.g. "
                f"[{L}, {2 * L}, {4 * L}, {8 * L}]"
            )
    lengths = [n for n in lengths if n >= L]
    table = {}
    for name in meta["variants"]:
        got = {int(k.removeprefix("ctx")): v["perplexity"] for k, v in metrics[name].items()}
        absent = [n for n in lengths if n not in got]
        if absent:
            raise config.UserError(
                f"context_study: variant {name} was not evaluated at context {absent[0]}; "
                f"re-run eval_perplexity on every variant with the same contexts"
            )
        table[name] = {n: got[n] for n in lengths}
    return lengths, table


def findings(meta: dict, table: dict, cfg: Config) -> list[dict]:
    """Rows of the report: result, paper, published (a bound), ours, tolerance, relation, finding."""
    L, E = meta["original_context"], meta["extended_context"]
    s = f"{meta['factor']:g}L"
    have = lambda *names: all(n in table for n in names)  # noqa: E731
    rows = []

    def row(result, paper, finding, ours, relation, published, tolerance=0.0):
        rows.append(
            {
                "result": result,
                "paper": paper,
                "finding": finding,
                "ours": ours,
                "relation": relation,
                "published": published,
                "tolerance": tolerance,
            }
        )

    base_L = table["unscaled"][L]
    row(
        f"unscaled: perplexity at {s} / at L",
        PI,
        "without scaling, perplexity explodes beyond the trained context",
        table["unscaled"][E] / base_L,
        ">=",
        cfg.unscaled_growth,
    )
    if have("linear-ft"):
        row(
            f"linear fine-tuned at {s} / base at L",
            PI,
            "interpolation plus a short fine-tune recovers perplexity at the extended context",
            table["linear-ft"][E] / base_L,
            "<=",
            1.0,
            cfg.finetuned_tolerance,
        )
    scaled = [n for n, v in meta["variants"].items() if not v["finetuned"] and n != "unscaled"]
    for name in scaled:
        if meta["variants"][name]["rope_parameters"]["rope_type"] == "linear":
            continue  # interpolation changes every frequency: it needs the fine-tune (finding above)
        row(
            f"{name} zero-shot at {s} / unscaled at {s}",
            YARN,
            "scaled RoPE without fine-tuning degrades less than unscaled RoPE beyond L",
            table[name][E] / table["unscaled"][E],
            "<=",
            1.0,
        )
    others = [n for n in scaled if n != "yarn"]
    if "yarn" in scaled and others:
        best = min(others, key=lambda n: table[n][E])
        row(
            f"yarn zero-shot at {s} / best other scaled ({best})",
            YARN,
            "YaRN degrades least of the scaling methods without fine-tuning",
            table["yarn"][E] / table[best][E],
            "<=",
            1.0,
        )
    if have("yarn-ft", "linear-ft"):
        row(
            f"yarn fine-tuned at {s} / linear fine-tuned at {s}",
            YARN,
            "with the same fine-tuning tokens, YaRN reaches lower perplexity than interpolation",
            table["yarn-ft"][E] / table["linear-ft"][E],
            "<=",
            1.0,
        )
    if have("unscaled-ft", "linear-ft"):
        for n in sorted({E, max(table["unscaled-ft"])}):
            row(
                f"direct fine-tune at {n // L}L / linear fine-tuned at {n // L}L",
                PI,
                "fine-tuning without interpolation extends the context less well than interpolation",
                table["unscaled-ft"][n] / table["linear-ft"][n],
                ">=",
                1.0,
            )
    return rows


def holds(row: dict) -> bool:
    ours, bound, tol = row["ours"], row["published"], row["tolerance"]
    if not math.isfinite(ours):
        return False
    return ours >= bound - tol if row["relation"] == ">=" else ours <= bound + tol


def position_table(meta: dict, metrics: dict, longest: int) -> dict:
    """{variant: {bucket: perplexity}} at the longest evaluated context (when buckets were asked for)."""
    return {
        name: {b: v["perplexity"] for b, v in metrics[name][f"ctx{longest}"].get("buckets", {}).items()}
        for name in meta["variants"]
    }


def render(meta: dict, lengths: list[int], table: dict, positions: dict, rows: list[dict]) -> str:
    L = meta["original_context"]
    head = [f"{n // L}L ({n})" if n % L == 0 else str(n) for n in lengths]
    lines = [
        "# Context-extension study",
        "",
        f"Base model trained at L = {L} tokens, extended by s = {meta['factor']:g} to {meta['extended_context']}; "
        f"fine-tuned variants trained {meta['finetune_steps']} steps at {meta['extended_context']}. "
        "Token perplexity on the test split, non-overlapping windows of each length.",
        "",
        "| method | fine-tuned | " + " | ".join(head) + " |",
        "|---|---|" + "---|" * len(lengths),
    ]
    for name, v in meta["variants"].items():
        lines.append(
            f"| {name} | {'yes' if v['finetuned'] else 'no'} | "
            + " | ".join(f"{table[name][n]:.2f}" for n in lengths)
            + " |"
        )
    buckets = sorted({b for p in positions.values() for b in p}, key=lambda b: int(b.split("-")[0]))
    if buckets:
        lines += [
            "",
            f"## Perplexity by token position in {lengths[-1]}-token windows",
            "",
            "| method | " + " | ".join(buckets) + " |",
            "|---|" + "---|" * len(buckets),
        ]
        for name, p in positions.items():
            lines.append(f"| {name} | " + " | ".join(f"{p[b]:.2f}" if b in p else "-" for b in buckets) + " |")
    lines += [
        "",
        "## Published findings",
        "",
        "| finding | paper | measured | ours | expected | holds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = f"{r['relation']} {r['published']:g}" + (f" (+{r['tolerance']:g})" if r["tolerance"] else "")
        lines.append(
            f"| {r['finding']} | {r['paper']} | {r['result']} | {r['ours']:.3f} | {bound} | "
            f"{'yes' if r['pass'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def plot(meta: dict, lengths: list[int], table: dict, positions: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, v in meta["variants"].items():
        ax.plot(
            lengths,
            [table[name][n] for n in lengths],
            marker="o",
            linestyle="-" if v["finetuned"] else "--",
            label=name,
        )
    ax.axvline(meta["original_context"], color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(
        xlabel="evaluation length (tokens)",
        ylabel="token perplexity",
        title=f"Context extension x{meta['factor']:g} (dashed: zero-shot, solid: fine-tuned)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / "perplexity_vs_length.png", dpi=110)
    plt.close(fig)
    if any(positions.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, p in positions.items():
            bs = sorted(p, key=lambda b: int(b.split("-")[0]))
            ax.plot(
                range(len(bs)),
                [p[b] for b in bs],
                marker="o",
                label=name,
                linestyle="-" if meta["variants"][name]["finetuned"] else "--",
            )
            ax.set_xticks(range(len(bs)), bs)
        ax.set_yscale("log")
        ax.set(
            xlabel=f"token position in {lengths[-1]}-token windows",
            ylabel="token perplexity",
            title="Perplexity by position",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(folder / "perplexity_by_position.png", dpi=110)
        plt.close(fig)


def write_study(folder: Path, meta: dict, lengths: list[int], table: dict, positions: dict, rows: list[dict]) -> dict:
    doc = {
        "original_context": meta["original_context"],
        "factor": meta["factor"],
        "lengths": lengths,
        "perplexity": {n: {str(k): v for k, v in t.items()} for n, t in table.items()},
        "positions": positions,
        "findings": rows,
    }
    atomic.write_json(folder / "study.json", doc)
    (folder / "study.md").write_text(render(meta, lengths, table, positions, rows), encoding="utf-8")
    atomic.write_json(
        folder / "results.json",
        [{k: r[k] for k in ("result", "paper", "published", "ours", "tolerance", "relation")} for r in rows],
    )
    counts = {"findings": len(rows), "findings_hold": sum(r["pass"] for r in rows)}
    stage.write_metrics(folder, {"perplexity": doc["perplexity"], **counts}, counts)
    with open(folder / "table.csv", "w") as fh:
        fh.write("method,finetuned,length,perplexity\n")
        for name, t in table.items():
            fh.writelines(f"{name},{meta['variants'][name]['finetuned']},{n},{p:.6f}\n" for n, p in t.items())
    plot(meta, lengths, table, positions, folder / "plots")
    return doc


def main(argv=None) -> dict:
    args, cfg = stage.setup(
        __doc__,
        STAGE,
        Config,
        {
            "extend": "data/extend_context",
            "eval": "data/eval_perplexity/extend_context",
            "output": "data/context_study",
        },
        argv,
    )
    extend, evaluated, output = Path(args.extend), Path(args.eval), Path(args.output)
    meta, metrics = load_inputs(extend, evaluated)
    lengths, table = perplexity_table(meta, metrics)
    positions = position_table(meta, metrics, lengths[-1])
    rows = [{**r, "pass": holds(r)} for r in findings(meta, table, cfg)]

    def body(rt, stop):
        if rt.is_main:
            inputs_hash = digest.hash_files([extend / "meta.json", evaluated / "figures.json"])
            with runs.start_run(
                STAGE, config.as_dict(cfg), inputs_hash, rt, tags=environment.run_tags(STAGE)
            ) as tracker:
                with atomic.folder(output) as tmp:
                    write_study(tmp, meta, lengths, table, positions, rows)
                tracker.log_metrics({f"{name}.ppl_{n}": p for name, t in table.items() for n, p in t.items()})
                tracker.log_metrics({"findings": len(rows), "findings_hold": sum(r["pass"] for r in rows)})
                for name in ("study.md", "study.json", "plots"):
                    tracker.log_artifact(output / name, "plots" if name == "plots" else None)
            print(
                f"context_study: {sum(r['pass'] for r in rows)} of {len(rows)} published findings hold "
                f"-> {output}/study.md"
            )
        return {"lengths": lengths, "perplexity": table, "findings": rows}

    return stage.launch(STAGE, body)


if __name__ == "__main__":
    stage.entry(main)
