"""GCN and GAT from PyTorch Geometric layers, fed sparse bag-of-words features.

Planetoid features are ~1% non-zero. As a sparse CSR tensor, input dropout draws one random number per
stored entry (a dropped zero stays zero, so the distribution equals dense dropout's; the GCN authors'
own code does the same) and the first layer multiplies sparsely in both passes. The layers are PyG's
GCNConv / GATConv with the first layer's `lin` replaced by SparseInputLinear, which holds the same
parameters: a state_dict of these models loads into the stock layers (as in PyG's examples/gcn.py and
gat.py: `conv1`, `conv2`), and dense inputs work too.

    model = build_model("gcn", in_channels=1433, hidden=16, out_channels=7, dropout=0.5)
    logits = model(data.x.to_sparse_csr(), data.edge_index)     # or data.x (dense)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout as F.dropout (keep with probability 1 - p, scale by 1 / (1 - p)), drawing uniform numbers:
    on CPU that is ~2x faster than F.dropout's bernoulli_. On a sparse CSR tensor only the stored
    entries are drawn for (a dropped zero stays zero, so the distribution is the same), and the index
    tensors are kept so that SparseInputLinear reuses its transposed layout."""
    if not training or p == 0:
        return x
    values = x.values() if x.layout == torch.sparse_csr else x
    dropped = values * (torch.rand_like(values) >= p).to(values.dtype).mul_(1.0 / (1.0 - p))
    if x.layout != torch.sparse_csr:
        return dropped
    return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), dropped, x.size(), check_invariants=False)


class _SparseMatmul(torch.autograd.Function):
    """x @ weight.T for a constant sparse CSR x; backward multiplies by x.T, also CSR (autograd's own
    backward converts x's layout on every step, ~20x the cost of the forward here)."""

    @staticmethod
    def forward(ctx, weight, x, x_t):
        ctx.x_t = x_t
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        return (ctx.x_t @ grad).t(), None, None


class SparseInputLinear(torch.nn.Module):
    """Stands in for the first conv's `lin` with the same parameters (so state_dicts match stock PyG
    layers): dense inputs go through F.linear, sparse CSR inputs through _SparseMatmul."""

    def __init__(self, lin: torch.nn.Module):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self._layout = None  # (col_indices, permutation to column order, crow and col of x.T)

    def reset_parameters(self):
        torch.nn.init.xavier_uniform_(self.weight)  # PyG's glorot

    def transpose(self, x: torch.Tensor) -> torch.Tensor:
        cols = x.col_indices()
        if self._layout is None or self._layout[0].data_ptr() != cols.data_ptr() or len(self._layout[0]) != len(cols):
            crow = x.crow_indices()
            rows = torch.repeat_interleave(torch.arange(x.size(0), device=cols.device), crow[1:] - crow[:-1])
            perm = torch.argsort(cols * x.size(0) + rows)
            crow_t = torch.zeros(x.size(1) + 1, dtype=crow.dtype, device=crow.device)
            crow_t[1:] = torch.cumsum(torch.bincount(cols, minlength=x.size(1)), 0)
            self._layout = (cols, perm, crow_t, rows[perm])
        _, perm, crow_t, col_t = self._layout
        return torch.sparse_csr_tensor(crow_t, col_t, x.values()[perm], (x.size(1), x.size(0)), check_invariants=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.layout != torch.sparse_csr:
            return F.linear(x, self.weight, self.bias)
        out = _SparseMatmul.apply(self.weight, x, self.transpose(x))
        return out if self.bias is None else out + self.bias


class GCN(torch.nn.Module):
    """Two GCNConv layers: dropout, conv, ReLU, dropout, conv (Kipf & Welling 2017)."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float, cached: bool = True):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.dropout = dropout
        self.conv1 = GCNConv(in_channels, hidden, cached=cached)
        self.conv2 = GCNConv(hidden, out_channels, cached=cached)
        self.conv1.lin = SparseInputLinear(self.conv1.lin)

    def forward(self, x, edge_index):
        x = self.conv1(dropout(x, self.dropout, self.training), edge_index).relu()
        return self.conv2(dropout(x, self.dropout, self.training), edge_index)


class GAT(torch.nn.Module):
    """Two GATConv layers: `heads` concatenated heads + ELU, then `output_heads` averaged heads
    (Velickovic et al. 2018); dropout on each layer's input and on the attention coefficients."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float, heads: int, output_heads: int):
        super().__init__()
        from torch_geometric.nn import GATConv

        self.dropout = dropout
        self.conv1 = GATConv(in_channels, hidden // heads, heads=heads, dropout=dropout)
        self.conv2 = GATConv(hidden, out_channels, heads=output_heads, concat=False, dropout=dropout)
        self.conv1.lin = SparseInputLinear(self.conv1.lin)

    def forward(self, x, edge_index):
        x = F.elu(self.conv1(dropout(x, self.dropout, self.training), edge_index))
        return self.conv2(dropout(x, self.dropout, self.training), edge_index)


def build_model(kind: str, **kwargs) -> torch.nn.Module:
    return {"gcn": GCN, "gat": GAT}[kind](**kwargs)
