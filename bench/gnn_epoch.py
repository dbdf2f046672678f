"""GNN epoch time: train_gnn's GCN and GAT vs a plain PyG loop, same data, hyperparameters and cores.

    python bench/gnn_epoch.py [--seeds 3] [--threads 1] [--input data/prepare_data]

Reads Cora's raw files from `--input` (prepare_data's output) or from PIPELINE_DATA_MIRROR. For each
seed and model it alternates, so that load on the machine falls on both alike:
  stage     stages.train_gnn.train_seed with the params.yaml hyperparameters: sparse input features,
            edges ordered by destination, fused Adam, one evaluation pass per epoch
  baseline  the loop of PyG's examples/gcn.py and gat.py: dense features and dropout, `train()` then
            `test()` every epoch, the test accuracy of the best validation epoch kept
Both train the papers' models for the same epochs and select by validation accuracy. Prints time per
epoch (a train step plus an evaluation), the ratio stage / baseline (goal <= 0.5) and mean ± std test
accuracy of each (goal: equal within noise).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages import train_gnn  # noqa: E402
from stages.common import config, runtime  # noqa: E402


class PlainGCN(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels, dropout):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.dropout = dropout
        self.conv1 = GCNConv(in_channels, hidden, cached=True)
        self.conv2 = GCNConv(hidden, out_channels, cached=True)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = self.conv1(x, edge_index).relu()
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


class PlainGAT(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels, dropout, heads, output_heads):
        super().__init__()
        from torch_geometric.nn import GATConv

        self.dropout = dropout
        self.conv1 = GATConv(in_channels, hidden // heads, heads=heads, dropout=dropout)
        self.conv2 = GATConv(hidden, out_channels, heads=output_heads, concat=False, dropout=dropout)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


def plain_run(kind: str, data, cfg: train_gnn.Config, seed: int) -> tuple[float, float]:
    """(test accuracy % at the best validation epoch, seconds): the PyG example loop."""
    kwargs = train_gnn.model_kwargs(kind, cfg, data.num_features, int(data.y.max()) + 1)
    kwargs.pop("cached", None)
    torch.manual_seed(seed)
    model = (PlainGCN if kind == "gcn" else PlainGAT)(**kwargs)
    optimizer = train_gnn.make_optimizer(kind, model, cfg, fused=False)  # the default Adam

    def train():
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        optimizer.step()
        return loss.item()

    @torch.no_grad()
    def test():
        model.eval()
        pred = model(data.x, data.edge_index).argmax(dim=-1)
        return [
            int((pred[m] == data.y[m]).sum()) / int(m.sum()) for m in (data.train_mask, data.val_mask, data.test_mask)
        ]

    t0 = time.perf_counter()
    best_val = test_acc = 0.0
    for _ in range(getattr(cfg, kind).epochs):
        train()
        _, val_acc, tmp_test_acc = test()
        if val_acc > best_val:
            best_val, test_acc = val_acc, tmp_test_acc
    return 100.0 * test_acc, time.perf_counter() - t0


def plain_data(inp: Path):
    """Cora as the PyG examples load it (edges in Planetoid's order)."""
    from torch_geometric.datasets import Planetoid
    from torch_geometric.transforms import NormalizeFeatures

    with tempfile.TemporaryDirectory() as root:
        shutil.copytree(inp / "planetoid" / "Cora" / "raw", Path(root) / "Cora" / "raw")
        return Planetoid(root, "Cora", transform=NormalizeFeatures())[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: train_gnn.threads of params.yaml")
    parser.add_argument("--input", default=None, help="prepare_data's output (default: PIPELINE_DATA_MIRROR)")
    parser.add_argument("--params", default=str(Path(__file__).resolve().parent.parent / "params.yaml"))
    args = parser.parse_args()
    cfg = config.load(train_gnn.Config, "train_gnn", args.params, ["dataset=Cora", "minibatch.enabled=false"])
    inp = Path(args.input or os.environ.get("PIPELINE_DATA_MIRROR") or "data/prepare_data")
    train_gnn.check_input(inp, "Cora")
    rt = runtime.init()  # one process; the stage's train_seed reads its device
    torch.set_num_threads(args.threads or cfg.threads)
    stage_data, base_data = train_gnn.load_planetoid(inp, "Cora"), plain_data(inp)

    acc = {(w, k): [] for w in ("stage", "baseline") for k in cfg.models}
    secs = {key: 0.0 for key in acc}
    for seed in range(cfg.first_seed, cfg.first_seed + args.seeds):
        for kind in cfg.models:
            r = train_gnn.train_seed(kind, stage_data, cfg, seed, rt)
            acc["stage", kind].append(r["test_acc"])
            secs["stage", kind] += r["train_s"]
            a, s = plain_run(kind, base_data, cfg, seed)
            acc["baseline", kind].append(a)
            secs["baseline", kind] += s
            print(
                f"seed {seed} {kind}: stage {r['test_acc']:.1f}% {r['train_s']:.1f}s, baseline {a:.1f}% {s:.1f}s",
                flush=True,
            )

    def pm(xs):
        return f"{statistics.fmean(xs):.1f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.1f}"

    print(f"\nCora, {args.seeds} seeds, {torch.get_num_threads()} thread(s)")
    print(
        f"{'model':6} {'stage ms/epoch':>15} {'baseline ms/epoch':>18} {'ratio':>6} "
        f"{'stage acc':>12} {'baseline acc':>13}"
    )
    for kind in cfg.models:
        epochs = args.seeds * getattr(cfg, kind).epochs
        st, bl = (1000 * secs[w, kind] / epochs for w in ("stage", "baseline"))
        print(
            f"{kind.upper():6} {st:15.1f} {bl:18.1f} {st / bl:6.2f} {pm(acc['stage', kind]):>12} "
            f"{pm(acc['baseline', kind]):>13}"
        )
    print("goal: ratio <= 0.5 at equal accuracy")


if __name__ == "__main__":
    main()
