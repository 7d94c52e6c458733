"""Re-homing a CPU-traced graph onto the compute device (compiler/capture.py).

No GPU here: the meta device stands in for CUDA. Mixing it with CPU tensors fails like CUDA
does, so a CPU device left in the graph shows up as an error when the graph runs."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from megatrain.compiler.capture import _replace_device_constants


class DeviceFollower(torch.nn.Module):
    """What Hugging Face models do: move a buffer and the labels to the activations' device,
    build positions on it, and hop through `.cpu()`."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4), persistent=False)

    def forward(self, x, labels):
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        angles = self.inv_freq.to(x.device)[:, None] * pos[None, :]
        y = x @ angles.cpu()
        return torch.nn.functional.cross_entropy(y, labels.to(y.device))


def _dynamo_graph(model, *args) -> fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def test_cpu_devices_in_the_graph_follow_the_compute_device():
    model = DeviceFollower()
    x, labels = torch.randn(3, 4), torch.randint(0, 4, (3,))
    gm = _dynamo_graph(model, x, labels)
    meta = torch.device("meta")
    inputs = [t.to(meta) for t in (x, labels, model.inv_freq)]
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    by_name = dict(zip(("l_x_", "l_labels_", "l_self_buffers_inv_freq_"), inputs))
    args = [by_name[n] for n in placeholders]
    with pytest.raises((RuntimeError, NotImplementedError)):
        gm(*args)  # as traced, the graph mixes devices once its inputs move
    _replace_device_constants(gm, meta)
    gm.recompile()
    out = gm(*args)
    assert out[0].device == meta
    for node in gm.graph.nodes:
        for a in fx.node.map_aggregate((node.args, node.kwargs), lambda a: a):
            assert a != torch.device("cpu") and a != "cpu", node.format_node()
