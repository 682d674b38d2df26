"""Tiny transformers models from random-init configs (nothing is downloaded), and
torch-only zoo entries with control flow and in-place buffer updates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import vision_models
from torch import nn
from torch.export import Dim, ExportedProgram

VOCAB = 128
BATCH, SEQ = 2, 16

# transformers imports torchvision whenever it is installed (tests/vision_models.py).
vision_models.make_torchvision_importable()


class HFWrapper(nn.Module):
    """Calls a transformers model with keyword ids and returns a plain tensor, so the
    exported program has one tensor input and one tensor output."""

    def __init__(self, model: nn.Module, output: str) -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids}
        if getattr(self.model.config, "use_cache", None) is not None:
            kwargs["use_cache"] = False
        out = self.model(**kwargs, return_dict=True)
        return out[self.output]  # type: ignore[no-any-return]


def bert(attn_implementation: str = "sdpa") -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
    )
    return HFWrapper(transformers.BertModel(config, add_pooling_layer=False), "last_hidden_state")


def gpt2(attn_implementation: str = "sdpa") -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return HFWrapper(transformers.GPT2LMHeadModel(config), "logits")


def llama(attn_implementation: str = "sdpa") -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return HFWrapper(transformers.LlamaForCausalLM(config), "logits")


class ResNetish(nn.Module):
    """Two residual blocks with BatchNorm, a strided stage and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.block1 = _Block(8, 8, stride=1)
        self.block2 = _Block(8, 16, stride=2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = self.block2(self.block1(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class CondModel(nn.Module):
    """``torch.cond`` on a data-dependent predicate, with parameters in both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(  # type: ignore[no-any-return]
            x.sum() > 0,
            lambda t: torch.nn.functional.gelu(self.a(t)),
            lambda t: torch.nn.functional.silu(self.b(t)) * 2,
            (x,),
        )


class RunningMean(nn.Module):
    """Updates two buffers in place on every call (a running mean and a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        self.steps.add_(1)
        self.mean.mul_(0.9).add_(y.detach().mean(0), alpha=0.1)
        return torch.layer_norm(y - self.mean, (8,))


@attrs.frozen
class ZooCase:
    """How to build a zoo module, its inputs, and which dims may be dynamic."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    dynamic: Callable[[], tuple[dict[int, Any], ...]] | None
    mutates_buffers: bool = False
    transformers: bool = False


def _ids() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)),)


def _randn(*shape: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(0)),)


def _batch_seq() -> tuple[dict[int, Any], ...]:
    return ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=32)},)


def _batch() -> tuple[dict[int, Any], ...]:
    return ({0: Dim("batch", min=1, max=8)},)


ZOO: dict[str, ZooCase] = {
    c.name: c
    for c in [
        ZooCase("bert", bert, _ids, _batch_seq, transformers=True),
        ZooCase("gpt2", lambda: gpt2("eager"), _ids, _batch_seq, transformers=True),
        ZooCase("llama", llama, _ids, _batch_seq, transformers=True),
        ZooCase("resnet", ResNetish, _randn(2, 3, 16, 16), _batch),
        ZooCase("cond", CondModel, _randn(4, 8), _batch),
        ZooCase("running_mean", RunningMean, _randn(4, 8), _batch, mutates_buffers=True),
    ]
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The eager module for a zoo entry, in eval mode, with deterministic weights."""
    torch.manual_seed(seed)
    module = ZOO[name].build().eval()
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):  # non-trivial statistics
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return module


def export(
    name: str, *, dynamic: bool = False, seed: int = 0
) -> tuple[nn.Module, ExportedProgram, tuple[torch.Tensor, ...]]:
    """Export a zoo entry (optionally with its dynamic dims); returns module, program, inputs."""
    case = ZOO[name]
    module = build(name, seed)
    args = case.inputs()
    shapes = case.dynamic() if dynamic and case.dynamic is not None else None
    ep = torch.export.export(module, args, dynamic_shapes=shapes)
    return module, ep, args


# Programs a torch release cannot export at all: (torch "major.minor", zoo name,
# dynamic) -> what export raises. This Llama's dynamic sequence length needs
# min(16*seq, 32*seq) == 16*seq for 2 <= seq <= 32, which torch 2.11 and 2.12 cannot
# prove; 2.13 can.
TORCH_CANNOT_EXPORT: dict[tuple[str, str, bool], str] = {
    ("2.11", "llama", True): "Constraints violated (seq)",
    ("2.12", "llama", True): "Constraints violated (seq)",
}


def torch_release() -> str:
    """The running torch as "major.minor" (2.15.0+cu132 -> 2.15)."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def export_or_skip(
    name: str, *, dynamic: bool = False
) -> tuple[nn.Module, ExportedProgram, tuple[torch.Tensor, ...]]:
    """:func:`export`, or skip the test where the running torch cannot export the
    program (:data:`TORCH_CANNOT_EXPORT`; test_fast_path checks that it still cannot)."""
    import pytest

    if ZOO[name].transformers:
        pytest.importorskip("transformers")
    reason = TORCH_CANNOT_EXPORT.get((torch_release(), name, dynamic))
    if reason is not None:
        pytest.skip(f"torch {torch.__version__} cannot export {name}: {reason}")
    return export(name, dynamic=dynamic)


def other_inputs(name: str) -> tuple[torch.Tensor, ...]:
    """Inputs of a different batch (and sequence) size, for dynamic programs."""
    case = ZOO[name]
    (x,) = case.inputs()
    if case.transformers:
        return (torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1)),)
    shape = (x.shape[0] + 1, *x.shape[1:])
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(1)),)
