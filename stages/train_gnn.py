"""train_gnn: GCN and GAT node classification on a Planetoid citation graph, reproducing the papers.

GCN (Kipf & Welling 2017) and GAT (Velickovic et al. 2018) with the papers' hyperparameters on the
public split of Cora (default), CiteSeer or PubMed, repeated over `seeds` seeds; each seed keeps the
epoch with the best validation accuracy (ties: lower validation loss) and reports its test accuracy.
Under torchrun the (model, seed) runs are dealt round-robin to the ranks and gathered; every process
uses `threads` threads and seeds its own run, so a seed gives the same result for any world size.

The models (stages/models/gnn.py) are PyG's GCNConv/GATConv layers fed the ~1%-dense bag-of-words
features as a sparse CSR matrix: dropout and the first layer touch only the non-zeros (the same
distribution and results as dense, several times faster), and the graph's edges are ordered by
destination. A saved state_dict loads into the stock PyG layers of the same shape.

`minibatch.enabled=true` trains each seed with all ranks together instead: DistributedDataParallel
over mini-batches from PyG's NeighborLoader where pyg-lib or torch-sparse is installed
(`minibatch.loader=auto`), else from RandomNodeLoader (induced subgraphs of random node partitions;
pure Python). Evaluation runs on the whole graph.

Reads data/prepare_data/planetoid/<Name>/raw/ (copied to a private folder: PyG writes processed/ next
to raw/). Writes data/train_gnn/: figures.json (accuracies per model: mean and spread over seeds,
epochs), metrics.json (mean test accuracy per model: DVC metrics), results.json (report rows),
seeds.json, plots/, and models/<model>-seed<N>.pt; the seconds it took (in all, per run and per seed)
go to --measured (measured/train_gnn.json in the pipeline), outside the output. The models load with
stages.models.gnn:
    ckpt = torch.load(path, weights_only=True)  # plain data: a file from a remote runs no code
    model = build_model(ckpt["model"], **ckpt["kwargs"]); model.load_state_dict(ckpt["state_dict"])

Run:
    python -m stages.train_gnn --input data/prepare_data --output data/train_gnn [key=value ...]
    torchrun --nproc-per-node 2 -m stages.train_gnn --input data/prepare_data --output data/train_gnn
    torchrun --nproc-per-node 2 -m stages.train_gnn minibatch.enabled=true gat.epochs=100
    snakemake --cores all train_gnn           # or: dvc repro train_gnn
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from stages.common import atomic, config, digest, runtime, sources, stage, timing
from stages.common.tracking.tracker import Tracker
from stages.models.gnn import build_model

STAGE = "train_gnn"
DATASETS = sources.PLANETOID_NAMES
MODELS = ("gcn", "gat")
LOADERS = ("auto", "neighbor", "random_node")
# Test accuracy (%) on the public split: GCN Table 2 of Kipf & Welling; GAT Table 2 of Velickovic et al.
PAPERS = {"gcn": "Kipf & Welling 2017 (GCN), Table 2", "gat": "Velickovic et al. 2018 (GAT), Table 2"}
PUBLISHED = {
    "gcn": {"Cora": 81.5, "CiteSeer": 70.3, "PubMed": 79.0},
    "gat": {"Cora": 83.0, "CiteSeer": 72.5, "PubMed": 79.0},
}
# Their spread: both papers average 100 runs (random initializations); GAT gives the standard deviation
# (83.0 ± 0.7 on Cora), GCN none (the report then assumes its runs spread as ours).
PUBLISHED_RUNS = 100
PUBLISHED_SD = {"gcn": dict.fromkeys(PUBLISHED["gcn"]), "gat": {"Cora": 0.7, "CiteSeer": 0.7, "PubMed": 0.3}}


def _at_least_one(section, *keys: str) -> None:
    for key in keys:
        if getattr(section, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(section, key)}")


def _dropout(section) -> None:
    if not 0 <= section.dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {section.dropout}")


@dataclass(frozen=True)
class GCNConfig:
    """GCN (Kipf & Welling 2017): two GCNConv layers, ReLU between them."""

    hidden: int
    dropout: float
    lr: float
    weight_decay: float
    epochs: int

    def __post_init__(self):
        _at_least_one(self, "hidden", "epochs")
        _dropout(self)


@dataclass(frozen=True)
class GATConfig:
    """GAT (Velickovic et al. 2018): two GATConv layers, ELU between them."""

    hidden: int
    heads: int
    output_heads: int
    dropout: float
    lr: float
    weight_decay: float
    epochs: int

    def __post_init__(self):
        _at_least_one(self, "hidden", "heads", "epochs")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be divisible by heads ({self.heads}): "
                f"each head gets hidden / heads features"
            )
        if self.output_heads < 0:
            raise ValueError(f"output_heads must be >= 0, got {self.output_heads}")
        _dropout(self)


@dataclass(frozen=True)
class MinibatchConfig:
    """DDP mini-batch training (instead of full-graph training, one seed per rank)."""

    enabled: bool
    loader: str
    parts: int
    neighbors: tuple[int, ...]
    batch_size: int

    def __post_init__(self):
        if self.loader not in LOADERS:
            raise ValueError(f"loader: unknown loader {self.loader!r}; valid: {', '.join(LOADERS)}")
        _at_least_one(self, "parts", "batch_size")
        if not self.neighbors or min(self.neighbors) < 1:
            raise ValueError(f"neighbors must be a non-empty list of counts >= 1, got {list(self.neighbors)}")


@dataclass(frozen=True)
class Config:
    dataset: str
    models: tuple[str, ...]
    seeds: int
    first_seed: int
    threads: int
    tolerance: float
    gcn: GCNConfig
    gat: GATConfig
    minibatch: MinibatchConfig

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset: unknown dataset {self.dataset!r}; valid: {', '.join(DATASETS)}")
        bad = [m for m in self.models if m not in MODELS]
        if bad or not self.models:
            raise ValueError(f"models: unknown model {bad[0] if bad else None!r}; valid: {', '.join(MODELS)}")
        _at_least_one(self, "seeds", "threads")


# --------------------------------------------------------------------------------------------- data
def raw_names(name: str) -> list[str]:
    """The raw files of a graph, relative to prepare_data's folder (keys of its meta.json "files")."""
    return [f"planetoid/{name}/raw/{fname}" for fname in sources.planetoid_files(name)]


def raw_files(inp: Path, name: str) -> list[Path]:
    return [inp / rel for rel in raw_names(name)]


def check_input(inp: Path, name: str) -> None:
    missing = [p.name for p in raw_files(inp, name) if not p.is_file()]
    if missing:
        raise config.UserError(
            f"train_gnn: {inp / 'planetoid' / name / 'raw'} lacks {', '.join(missing)}; the raw Planetoid files "
            f"must be there: add {name} to prepare_data.graphs and run prepare_data, or pass --input"
        )
    check_published(inp / "planetoid" / name / "raw", name)


def check_published(raw: Path, name: str) -> None:
    """PyG's Planetoid unpickles the raw files: only the published ones (their known sha256) are read."""
    for fname, known in sources.planetoid_files(name).items():
        got = digest.sha256_file(raw / fname)
        if got != known.sha256:
            raise config.UserError(
                f"train_gnn: {raw / fname} is not the published Planetoid file (sha256 {got}, expected "
                f"{known.sha256}, {known.size:,} bytes); PyG unpickles it, so it is not read: run prepare_data "
                "again, which fetches and verifies it"
            )


def load_planetoid(inp: Path, name: str):
    """The public split with row-normalised features, read from a private copy of the raw files."""
    import warnings

    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    from torch_geometric.datasets import Planetoid
    from torch_geometric.transforms import NormalizeFeatures

    with tempfile.TemporaryDirectory(prefix="train_gnn-") as root:
        raw = Path(root) / name / "raw"
        raw.mkdir(parents=True)
        for path in raw_files(inp, name):
            shutil.copy(path, raw / path.name)
        check_published(raw, name)  # the copy PyG reads
        data = Planetoid(root, name, split="public", transform=NormalizeFeatures())[0]
    # The same edges ordered by destination: message passing scatters into contiguous rows (~25% faster GAT).
    data.edge_index = data.edge_index[:, torch.argsort(data.edge_index[1] * data.num_nodes + data.edge_index[0])]
    return data


def neighbor_loader_available() -> bool:
    import torch_geometric.typing as pyg_typing

    return bool(pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE)


# -------------------------------------------------------------------------------------------- model
def model_kwargs(kind: str, cfg: Config, num_features: int, num_classes: int) -> dict:
    kwargs = dict(in_channels=num_features, hidden=getattr(cfg, kind).hidden, out_channels=num_classes)
    if kind == "gcn":
        return dict(kwargs, dropout=cfg.gcn.dropout, cached=not cfg.minibatch.enabled)
    output_heads = cfg.gat.output_heads or (8 if cfg.dataset == "PubMed" else 1)
    return dict(kwargs, dropout=cfg.gat.dropout, heads=cfg.gat.heads, output_heads=output_heads)


def make_optimizer(kind: str, model: torch.nn.Module, cfg: Config, fused: bool = True) -> torch.optim.Optimizer:
    """Adam; fused (one kernel for all parameters) is ~10x faster than the default on CPU for these sizes."""
    if kind == "gcn":  # weight decay on the first layer only, as in the paper
        return torch.optim.Adam(
            [
                dict(params=model.conv1.parameters(), weight_decay=cfg.gcn.weight_decay),
                dict(params=model.conv2.parameters(), weight_decay=0.0),
            ],
            lr=cfg.gcn.lr,
            fused=fused,
        )
    return torch.optim.Adam(model.parameters(), lr=cfg.gat.lr, weight_decay=cfg.gat.weight_decay, fused=fused)


# ------------------------------------------------------------------------------------------ training
def train_step(model, optimizer, x, edge_index, y, index) -> float:
    """One optimizer step on the loss of the nodes in `index`; `model` may be DDP-wrapped (gradients averaged)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    out = model(x, edge_index)
    loss = F.cross_entropy(out[index], y[index], reduction="sum") / max(len(index), 1)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
@timing.phase("evaluation")
def evaluate(model, x, edge_index, y, val_index, test_index) -> tuple[float, float, float]:
    """(val accuracy %, val loss, test accuracy %) from one forward pass in eval mode."""
    model.eval()
    out = model(x, edge_index)
    val_out, test_out = out[val_index], out[test_index]
    val_loss = F.cross_entropy(val_out, y[val_index]).item()
    val_acc = 100.0 * (val_out.argmax(-1) == y[val_index]).float().mean().item()
    return val_acc, val_loss, 100.0 * (test_out.argmax(-1) == y[test_index]).float().mean().item()


def minibatches(data, cfg: Config, rt: runtime.Runtime, seed: int, epoch: int):
    """This rank's batches for one epoch, each with `seed_index`: the nodes whose loss counts. Every rank
    gets the same number of batches (DDP needs matching steps)."""
    mb = cfg.minibatch
    if mb.loader == "neighbor" or (mb.loader == "auto" and neighbor_loader_available()):
        from torch_geometric.loader import NeighborLoader

        train = data.train_mask.nonzero().view(-1)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        share = len(train) // rt.world_size
        mine = train[order[rt.rank * share : (rt.rank + 1) * share]]
        for batch in NeighborLoader(data, num_neighbors=list(mb.neighbors), input_nodes=mine, batch_size=mb.batch_size):
            batch.seed_index = torch.arange(batch.batch_size)
            yield batch
        return
    from torch.utils.data.distributed import DistributedSampler
    from torch_geometric.loader import RandomNodeLoader

    sampler = DistributedSampler(range(data.num_nodes), num_replicas=rt.world_size, rank=rt.rank, seed=seed)
    sampler.set_epoch(epoch)
    for batch in RandomNodeLoader(data, num_parts=mb.parts, sampler=sampler):
        batch.seed_index = batch.train_mask.nonzero().view(-1)
        yield batch


def train_seed(kind: str, data, cfg: Config, seed: int, rt: runtime.Runtime, stop=None) -> dict:
    """Train one model from `seed`; returns the best-validation epoch's figures, curves and weights.
    A set `stop` flag (runtime.handle_signals) raises runtime.Stopped before the next epoch; in
    mini-batch mode the ranks agree on it, so that they stop at the same epoch."""
    device = rt.device
    kwargs = model_kwargs(kind, cfg, data.num_features, int(data.y.max()) + 1)
    torch.manual_seed(seed)
    model = build_model(kind, **kwargs).to(device)
    optimizer = make_optimizer(kind, model, cfg)
    trained = model
    if cfg.minibatch.enabled and rt.distributed:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model)
    x, edge_index, y = data.x.to(device).to_sparse_csr(), data.edge_index.to(device), data.y.to(device)
    train_index, val_index, test_index = (
        m.nonzero().view(-1).to(device) for m in (data.train_mask, data.val_mask, data.test_mask)
    )
    curves = {"train_loss": [], "val_acc": [], "val_loss": [], "test_acc": []}
    best, best_state, t0 = None, None, time.perf_counter()
    for epoch in range(getattr(cfg, kind).epochs):
        if stop is not None and (runtime.any_rank(bool(stop)) if cfg.minibatch.enabled else stop):
            raise runtime.Stopped
        if cfg.minibatch.enabled:
            losses = [
                train_step(
                    trained,
                    optimizer,
                    b.x.to(device).to_sparse_csr(),
                    b.edge_index.to(device),
                    b.y.to(device),
                    b.seed_index.to(device),
                )
                for b in minibatches(data, cfg, rt, seed, epoch)
            ]
            loss = sum(losses) / max(len(losses), 1)
        else:
            loss = train_step(trained, optimizer, x, edge_index, y, train_index)
        val_acc, val_loss, test_acc = evaluate(model, x, edge_index, y, val_index, test_index)
        for key, value in zip(curves, (loss, val_acc, val_loss, test_acc), strict=True):
            curves[key].append(value)
        if best is None or (val_acc, -val_loss) > (best["val_acc"], -best["val_loss"]):
            best = {"epoch": epoch, "val_acc": val_acc, "val_loss": val_loss, "test_acc": test_acc}
            best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {
        "model": kind,
        "seed": seed,
        **best,
        "train_s": time.perf_counter() - t0,
        "curves": curves,
        "kwargs": kwargs,
        "state_dict": best_state,
    }


# ------------------------------------------------------------------------------------------- outputs
def summarize(results: list[dict], cfg: Config) -> dict:
    out = {"dataset": cfg.dataset, "seeds": cfg.seeds, "minibatch": cfg.minibatch.enabled}
    for kind in cfg.models:
        rows = [r for r in results if r["model"] == kind]
        test = [r["test_acc"] for r in rows]
        out[kind] = {
            "test_acc_mean": statistics.fmean(test),
            "test_acc_std": statistics.stdev(test) if len(test) > 1 else 0.0,
            "val_acc_mean": statistics.fmean(r["val_acc"] for r in rows),
            "best_epoch_mean": statistics.fmean(r["epoch"] for r in rows),
        }
    return out


def mean_curves(results: list[dict], kind: str) -> dict[str, list[float]]:
    rows = [r["curves"] for r in results if r["model"] == kind]
    return {key: [statistics.fmean(c[key][e] for c in rows) for e in range(len(rows[0][key]))] for key in rows[0]}


def result_rows(summary: dict, cfg: Config) -> list[dict]:
    return [
        {
            "result": f"{kind.upper()} test accuracy on {cfg.dataset} (%), mean of {cfg.seeds} seeds",
            "paper": PAPERS[kind],
            "published": PUBLISHED[kind][cfg.dataset],
            "ours": round(summary[kind]["test_acc_mean"], 2),
            "tolerance": cfg.tolerance,  # used by the report only where the spread is not estimated
            "spread": {
                "n": cfg.seeds,
                "sd": round(summary[kind]["test_acc_std"], 4) if cfg.seeds > 1 else None,
                "published_n": PUBLISHED_RUNS,
                "published_sd": PUBLISHED_SD[kind][cfg.dataset],
            },
            "data": raw_names(cfg.dataset),
        }
        for kind in cfg.models
    ]


def plot_accuracy(results: list[dict], summary: dict, cfg: Config, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve_ax, seed_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for i, kind in enumerate(cfg.models):
        curve_ax.plot(mean_curves(results, kind)["val_acc"], label=f"{kind.upper()} validation (mean of seeds)")
        test = [r["test_acc"] for r in results if r["model"] == kind]
        seed_ax.scatter([i] * len(test), test, alpha=0.6, label=f"{kind.upper()} per seed")
        seed_ax.errorbar(
            i + 0.15,
            summary[kind]["test_acc_mean"],
            yerr=summary[kind]["test_acc_std"],
            fmt="o",
            color="black",
            capsize=4,
        )
        if not cfg.minibatch.enabled:
            seed_ax.scatter(
                i + 0.3,
                PUBLISHED[kind][cfg.dataset],
                marker="*",
                s=120,
                color="red",
                label="published" if i == 0 else None,
            )
    curve_ax.set(xlabel="epoch", ylabel="accuracy (%)", title=f"{cfg.dataset}: validation accuracy")
    seed_ax.set(
        xticks=range(len(cfg.models)),
        xticklabels=[m.upper() for m in cfg.models],
        ylabel="test accuracy (%)",
        title="test accuracy at best validation epoch (mean ± std)",
    )
    curve_ax.legend()
    seed_ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log_curves(tracker: Tracker, results: list[dict], cfg: Config) -> None:
    """Per-epoch means over seeds, one point per epoch and curve (sent in batches by the tracker)."""
    tracker.log_series(
        {f"{kind}_{key}": list(values) for kind in cfg.models for key, values in mean_curves(results, kind).items()}
    )


def save_outputs(tmp: Path, cfg: Config, results: list[dict], weights: dict) -> dict:
    """Rank 0 writes the output folder into `tmp`; returns figures.json's contents."""
    summary = summarize(results, cfg)
    (tmp / "models").mkdir()
    for (kind, seed), (kwargs, state) in weights.items():
        record = {"model": kind, "kwargs": kwargs, "dataset": cfg.dataset, "seed": seed, "config": config.as_dict(cfg)}
        # Through JSON: fresh objects, so the file's pickle is the same bytes whichever process trained the
        # model (pickle writes a string shared by two fields once, and a gathered copy is no longer shared).
        record = json.loads(json.dumps(record))
        torch.save({**record, "state_dict": state}, tmp / "models" / f"{kind}-seed{seed}.pt")
    atomic.write_json(
        tmp / "seeds.json", [{k: v for k, v in r.items() if k not in ("curves", "train_s")} for r in results]
    )
    if not cfg.minibatch.enabled:
        atomic.write_json(tmp / "results.json", result_rows(summary, cfg))
    plot_accuracy(results, summary, cfg, tmp / "plots" / "accuracy.png")
    stage.write_metrics(tmp, summary, {"test_acc": {kind: summary[kind]["test_acc_mean"] for kind in cfg.models}})
    return summary


def measured_times(results: list[dict], cfg: Config, rt: runtime.Runtime, t_start: float) -> dict:
    """The seconds this run took: in all (from the start of the process), per model and seed, and per
    seed on average; and the processes it ran in. Measured, not computed: outside the output."""
    return {
        "wall_s": time.perf_counter() - t_start,
        "world_size": rt.world_size,
        "train_s": {f"{r['model']}-seed{r['seed']}": r["train_s"] for r in results},
        "train_s_per_seed": {
            kind: statistics.fmean(r["train_s"] for r in results if r["model"] == kind) for kind in cfg.models
        },
    }


def run(
    cfg: Config, inp: Path, output: Path, measured: Path, rt: runtime.Runtime, stop: runtime.StopFlag, t_start: float
) -> dict:
    torch.set_num_threads(cfg.threads)
    with stage.tracked(STAGE, cfg, raw_files(inp, cfg.dataset), rt) as (tracker, _):
        data = load_planetoid(inp, cfg.dataset)
        seeds = range(cfg.first_seed, cfg.first_seed + cfg.seeds)
        tasks = [(kind, seed) for kind in cfg.models for seed in seeds]
        if not cfg.minibatch.enabled:  # one task per process at a time, dealt round-robin
            tasks = tasks[rt.rank :: rt.world_size]
        mine = []
        for kind, seed in runtime.progress(tasks, rt=rt, desc="train_gnn", unit="run"):
            mine.append(train_seed(kind, data, cfg, seed, rt, stop))
        # Every rank's runs, weights included, on every rank (mini-batch: each rank has each run; the last wins).
        gathered = {(r["model"], r["seed"]): r for part in runtime.gather_objects(mine) for r in part}
        keys = sorted(gathered, key=lambda key: (cfg.models.index(key[0]), key[1]))
        weights = {key: (gathered[key].pop("kwargs"), gathered[key].pop("state_dict")) for key in keys}
        results = [gathered[key] for key in keys]
        summary = stage.publish(output, rt, lambda tmp: save_outputs(tmp, cfg, results, weights))
        times = measured_times(results, cfg, rt, t_start)
        if rt.is_main:
            stage.write_measured(measured, output, times)
            tracker.log_artifact(measured)
            tracker.log_metrics(
                {
                    "wall_s": times["wall_s"],
                    **{f"{kind}_train_s_per_seed": value for kind, value in times["train_s_per_seed"].items()},
                    **{f"{kind}_{key}": value for kind in cfg.models for key, value in summary[kind].items()},
                }
            )
            log_curves(tracker, results, cfg)
            for name in ("figures.json", "seeds.json", "plots", "models"):
                tracker.log_artifact(output / name, name if name in ("plots", "models") else None)
    runtime.print0(
        f"train_gnn: {cfg.dataset}, {cfg.seeds} seeds: "
        + ", ".join(
            f"{k.upper()} {summary[k]['test_acc_mean']:.2f} ± {summary[k]['test_acc_std']:.2f}" for k in cfg.models
        )
        + f" ({times['wall_s']:.1f} s) -> {output}",
        rt=rt,
    )
    return {"summary": summary, "seeds": results, "measured": times}


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    args, cfg = stage.setup(__doc__, STAGE, Config, {"input": "data/prepare_data", "output": "data/train_gnn"}, argv)
    inp, output = Path(args.input), Path(args.output)
    check_input(inp, cfg.dataset)
    if cfg.minibatch.enabled and cfg.minibatch.loader == "neighbor" and not neighbor_loader_available():
        raise config.UserError(
            "train_gnn.minibatch.loader is 'neighbor' but NeighborLoader needs pyg-lib or torch-sparse, "
            "neither of which is installed; use minibatch.loader=auto or minibatch.loader=random_node"
        )
    measured = Path(args.measured)
    return stage.launch(STAGE, lambda rt, stop: run(cfg, inp, output, measured, rt, stop, t_start))


if __name__ == "__main__":
    stage.entry(main)
