"""The model zoo the tests share: small modules with the state shapes that matter."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn
from torch.export import Dim, ExportedProgram


class Seed(nn.Module):
    """A linear layer plus a buffer mutated in place with ``add_`` on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.linear(x) + self.count


class NoConstants(nn.Module):
    """Parameters only: ``ep.constants`` is an empty dict (torch's ``or {}`` trap)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Mixed(nn.Module):
    """Tied weights, persistent and non-persistent buffers, a tensor attribute and a
    constant created in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("shift", torch.full((4,), 0.5), persistent=False)
        self.offset = torch.linspace(0, 1, 4)  # plain tensor attribute -> constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * self.scale + self.shift
        bias = torch.tensor([1.0, -1.0, 0.5, 0.0])  # constant created in forward
        return self.head(h) + self.offset + bias


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 16, 16, 4)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class ConvBN(nn.Module):
    """A small CNN with BatchNorm, meant to be exported in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def transformer_encoder(layers: int = 2, d_model: int = 32, nhead: int = 4) -> nn.Module:
    layer = nn.TransformerEncoderLayer(
        d_model, nhead, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True
    )
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


@attrs.frozen
class Case:
    """A zoo entry: how to build the module and its example inputs."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    dynamic_batch: bool = True


def _randn(*shape: int) -> Callable[[], tuple[torch.Tensor]]:
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(0)),)


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case("seed", Seed, _randn(2, 4)),
        Case("no_constants", NoConstants, _randn(2, 4)),
        Case("mixed", Mixed, _randn(2, 4)),
        Case("mlp", MLP, _randn(3, 8)),
        Case("convbn", ConvBN, _randn(2, 3, 8, 8)),
        Case("transformer", transformer_encoder, _randn(2, 5, 32)),
    ]
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    module = CASES[name].build().eval()
    if name == "convbn":
        # Non-trivial running statistics, so folding BatchNorm is really tested.
        for bn in (module.bn1, module.bn2):  # type: ignore[union-attr]
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
    return module


def export(
    name: str, *, dynamic: bool = False, seed: int = 0
) -> tuple[nn.Module, ExportedProgram, tuple[Any, ...]]:
    """Build a zoo module and export it (optionally with a dynamic batch dimension).

    Returns the eager module, the program and the example inputs.
    """
    module = build(name, seed)
    args = CASES[name].inputs()
    dynamic_shapes = None
    if dynamic:
        batch = Dim("batch", min=1, max=64)
        dynamic_shapes = tuple({0: batch} for _ in args)
    ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    return module, ep, args


def fresh_eager(name: str, seed: int = 0) -> nn.Module:
    """A second eager copy with the same initial state (for modules that mutate buffers)."""
    return build(name, seed)


class InplaceCNN(nn.Module):
    """A small CNN as torchvision writes them: BatchNorm, in-place ReLU, a residual
    ``+=`` and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        )
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.bn(self.conv(x))
        y += x
        y = self.relu(y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


class CausalDecoder(nn.Module):
    """A small decoder-only language model: token and position embeddings, pre-norm
    blocks of causal self-attention (written out, with a mask made from the sequence
    length) and a GELU MLP, and a head."""

    def __init__(self, vocab: int = 64, d_model: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(64, d_model)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(d_model),
                    "qkv": nn.Linear(d_model, 3 * d_model),
                    "out": nn.Linear(d_model, d_model),
                    "norm2": nn.LayerNorm(d_model),
                    "up": nn.Linear(d_model, 4 * d_model),
                    "down": nn.Linear(4 * d_model, d_model),
                }
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, seq = ids.shape
        x = self.embed(ids) + self.position(torch.arange(seq, device=ids.device))
        mask = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).chunk(3, dim=-1)
            q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
            attention = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
            x = x + block["out"](attention.transpose(1, 2).reshape(batch, seq, -1))
            x = x + block["down"](nn.functional.gelu(block["up"](block["norm2"](x))))
        return self.head(self.norm(x))  # type: ignore[no-any-return]


# Dynamic programs as users lower them: a CNN with a dynamic batch, and a decoder
# with a dynamic batch and sequence length.
DYNAMIC: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]], Any]] = {
    "cnn": (InplaceCNN, _randn(2, 3, 16, 16), lambda: ({0: Dim("batch", min=2, max=64)},)),
    "decoder": (
        CausalDecoder,
        lambda: (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),),
        lambda: ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=64)},),
    ),
}


def export_dynamic(name: str, seed: int = 0) -> tuple[nn.Module, ExportedProgram, tuple[Any, ...]]:
    """Export a program of ``DYNAMIC`` with its dynamic dimensions (eval mode,
    deterministic weights); returns the module, the program and the example inputs."""
    make, inputs, dims = DYNAMIC[name]
    torch.manual_seed(seed)
    module = make().eval()
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):  # non-trivial statistics
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    args = inputs()
    return module, torch.export.export(module, args, dynamic_shapes=dims()), args
