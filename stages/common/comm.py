"""Bytes a process sends to the others, counted from the communication ops as they run.

CommCounter is a TorchDispatchMode: inside it, every collective and point-to-point op that reaches
the dispatcher is seen with its real tensors — DDP's bucket all-reduces (issued by its C++ reducer),
FSDP2's all-gathers and reduce-scatters, the functional collectives of DTensor redistributions
(tensor parallel), the sends of pipeline stages — whatever layer issued it. Ops on DTensors are
handed back to DTensor first (NotImplemented), so the collectives they turn into are seen too.

Each op is counted as the bytes this rank sends under the bandwidth-optimal algorithms NCCL runs
(ring), for a tensor of S bytes over a group of n:

    all-reduce                      2 (n - 1) / n x S
    all-gather (S: the output)      (n - 1) / n x S
    reduce-scatter (S: the input)   (n - 1) / n x S
    all-to-all, broadcast           (n - 1) / n x S   (broadcast: pipelined, per rank on average)
    send                            S;  receive: 0

so that a layout's measured figure compares with its analytic one, whatever algorithm gloo ran.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, which argument holds the tensor(s) S is taken from)
OPS = {
    "c10d.allreduce_": ("all_reduce", 0),
    "c10d.allreduce_coalesced_": ("all_reduce", 0),
    "c10d._allgather_base_": ("all_gather", 0),  # (output, input, group, ...)
    "c10d.allgather_": ("all_gather", 0),  # (outputs: one list per input, ...)
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input, ...)
    "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.alltoall_base_": ("all_to_all", 1),
    "c10d.broadcast_": ("broadcast", 0),
    "c10d.send": ("send", 0),
    "_c10d_functional.all_reduce": ("all_reduce", 0),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0),  # (input, group_size, ...): S = n x input
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0),
    "_c10d_functional.broadcast": ("broadcast", 0),
}
FACTOR = {  # bytes sent per byte of S, over a group of n
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}


def tensor_bytes(value) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def group_size(name: str, args: tuple) -> int:
    """The size of the group an op runs over: its ProcessGroup argument (c10d ops) or the group named
    by its group_name argument (functional collectives)."""
    from torch.distributed import distributed_c10d

    if name.startswith("_c10d_functional."):
        return distributed_c10d._resolve_process_group(args[-1]).size()
    for arg in args:  # (the dispatcher passes it boxed, as a TorchScript object)
        if isinstance(arg, torch.ScriptObject):
            return torch.distributed.ProcessGroup.unbox(arg).size()
        if isinstance(arg, torch.distributed.ProcessGroup):
            return arg.size()
    raise ValueError(f"{name}: no process group among its arguments")


class CommCounter(TorchDispatchMode):
    """Within `with CommCounter() as counter:`, `counter.sent` is the bytes this rank has sent (see the
    module docstring) and `counter.by_kind` / `counter.calls` the same bytes and the op counts per kind."""

    def __init__(self):
        super().__init__()
        self.by_kind: Counter = Counter()
        self.calls: Counter = Counter()

    @property
    def sent(self) -> float:
        return sum(self.by_kind.values())

    def reset(self) -> None:
        self.by_kind.clear()
        self.calls.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types):
            return NotImplemented  # DTensor first: the collectives it turns the op into come back here
        name = f"{func.namespace}.{func._opname}"
        if name in OPS:
            kind, index = OPS[name]
            size = tensor_bytes(args[index])
            if name == "_c10d_functional.all_gather_into_tensor":
                size *= args[1]  # (input, group_size, group_name): the output is group_size inputs
            elif name == "_c10d_functional.all_gather_into_tensor_coalesced":
                size *= args[1]
            self.by_kind[kind] += FACTOR[kind](group_size(name, args)) * size
            self.calls[kind] += 1
        return func(*args, **kwargs)
