"""An asynchronous checkpoint whose copy to host memory fails on one rank only; run under torchrun
(2 CPU processes).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/checkpoint_failure_probe.py <folder>

Rank 1's stager raises MemoryError. Every rank must leave the save with an error (rank 1 its own, rank 0
"another rank failed"), with no checkpoint in flight and no folder left behind, and the ranks must still
agree on their collectives afterwards (an all-reduce and a synchronous save that both complete): none
goes on to train while another removes the folder. No rank may have started writing that save (a write
started on rank 0 goes on in its thread and can make the folder again after it was removed). Exits 0
when all of that holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from stages.common import checkpointer, runtime


def main(folder: Path) -> None:
    rt = runtime.init(timeout_s=60)
    started = []  # the folders this rank's DCP writes began to lay out
    prepare = FileSystemWriter.prepare_local_plan

    def recorded(self, plan):
        started.append(str(self.path))
        return prepare(self, plan)

    FileSystemWriter.prepare_local_plan = recorded
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    saver = checkpointer.Checkpointer(folder, every=2, steps=8, rt=rt, asynchronous=True, timeout_s=60)
    if rt.rank == 1:

        def fail(*args, **kwargs):
            raise MemoryError("no host memory for the staging copy")

        saver.stager.stage = fail
    state = checkpointer.TrainState(step=2)
    try:
        saver.save(state, model, optimizer, wait=False)
    except MemoryError:
        assert rt.rank == 1
    except RuntimeError as e:
        assert rt.rank == 0 and "another rank failed while saving" in str(e), e
    else:
        raise AssertionError(f"rank {rt.rank}: the save returned though rank 1's copy failed")
    assert saver.pending is None
    assert started == [], f"rank {rt.rank} started writing a save that another rank's failure abandoned: {started}"
    t = torch.ones(1)
    dist.all_reduce(t)  # the ranks still meet on the same collective
    assert t.item() == 2
    runtime.barrier()
    assert not list(folder.iterdir()), sorted(p.name for p in folder.iterdir())
    runtime.barrier()  # every rank has looked before any starts the next save's folder
    state.step = 4
    saver.save(state, model, optimizer, wait=True)  # a synchronous save: every rank, published
    assert (folder / "step-4/manifest.json").is_file()
    saver.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
