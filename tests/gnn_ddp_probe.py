"""One DDP step of train_gnn's GCN with a different batch on each rank; run under torchrun (2 CPU processes).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/gnn_ddp_probe.py <planetoid root> <out.json>

Each rank takes its own random half of Cora's nodes (induced subgraph) and, from the same initial
weights and the same dropout masks, makes one SGD step three ways: through DDP with the stage's
`train_step`; alone (no synchronization); and alone with gradients averaged by hand (all_reduce).
Rank 0 writes every rank's flattened parameters after each, for tests/test_train_gnn.py to compare.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from stages import train_gnn
from stages.common import runtime
from stages.models import gnn


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def main(root: str, out: str) -> None:
    rt = runtime.init()
    torch.set_num_threads(1)
    data = train_gnn.load_planetoid(Path(root), "Cora")
    nodes = torch.randperm(data.num_nodes, generator=torch.Generator().manual_seed(0))[rt.rank :: rt.world_size]
    batch = data.subgraph(nodes)
    x, index = batch.x.to_sparse_csr(), batch.train_mask.nonzero().view(-1)
    torch.manual_seed(0)
    model = gnn.build_model("gcn", in_channels=data.num_features, hidden=16, out_channels=7, dropout=0.5, cached=False)
    alone, averaged = copy.deepcopy(model), copy.deepcopy(model)

    ddp = DistributedDataParallel(model)
    torch.manual_seed(100 + rt.rank)  # the same dropout masks for the three ways on this rank
    train_gnn.train_step(ddp, torch.optim.SGD(model.parameters(), lr=1.0), x, batch.edge_index, batch.y, index)

    for net, sync in ((alone, False), (averaged, True)):
        torch.manual_seed(100 + rt.rank)
        net.train()
        F.cross_entropy(net(x, batch.edge_index)[index], batch.y[index]).backward()
        if sync:
            for p in net.parameters():
                torch_dist.all_reduce(p.grad)
                p.grad /= rt.world_size
        torch.optim.SGD(net.parameters(), lr=1.0).step()

    report = runtime.gather_objects(
        {"ddp": flat(model), "alone": flat(alone), "averaged": flat(averaged), "train_nodes": len(index)}
    )
    if rt.is_main:
        Path(out).write_text(json.dumps(report))
    runtime.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
