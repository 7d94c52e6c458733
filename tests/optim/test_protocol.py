"""Every optimizer the runtime can meet implements the declared GradientConsumer protocol:
the same method names and parameters, so the runtime calls them without probing."""

import inspect

import pytest
import torch

import megatrain
from megatrain.optim import registry
from megatrain.optim.protocol import GradientConsumer

MEMBERS = [name for name, value in vars(GradientConsumer).items()
           if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("cls", [megatrain.AdamW, megatrain.ShardedAdamW], ids=lambda c: c.__name__)
def test_the_optimizers_implement_the_protocol_with_its_signatures(cls):
    assert issubclass(cls, GradientConsumer)
    if cls is megatrain.AdamW:
        assert isinstance(cls([torch.nn.Parameter(torch.randn(4, 4))], lr=1e-3), GradientConsumer)
    for name in MEMBERS:
        declared = inspect.signature(getattr(GradientConsumer, name))
        actual = inspect.signature(getattr(cls, name))
        assert list(declared.parameters) == list(actual.parameters), (name, declared, actual)
        kinds = [p.kind for p in declared.parameters.values()]
        assert kinds == [p.kind for p in actual.parameters.values()], name


def test_the_registry_takes_only_protocol_optimizers():
    p = torch.nn.Parameter(torch.randn(2))
    with pytest.raises(AssertionError):
        registry.register([p], torch.optim.SGD([p], lr=0.1))
    assert registry.owner_of(p) is None
