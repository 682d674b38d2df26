"""Lower a small model with epass and show that its state stays shared."""

import copy

import torch

from epass import Decompose, PassManager


class Seed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.linear(x) + self.count


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    model = Seed()
    reference = copy.deepcopy(model)  # running a program updates its `count` buffer
    ep = torch.export.export(model, (x,))

    bare = ep.run_decompositions()
    print("torch run_decompositions keeps state_dict:", bare.state_dict is ep.state_dict)

    result = PassManager([Decompose()])(ep)
    out = result.program
    print(result.summary())
    print("epass keeps state_dict:", out.state_dict is ep.state_dict)
    print("epass keeps constants: ", out.constants is ep.constants)
    assert out.state_dict is ep.state_dict and out.constants is ep.constants
    torch.testing.assert_close(out.module()(x), reference(x))
    print("numerics match the eager model")


if __name__ == "__main__":
    main()
