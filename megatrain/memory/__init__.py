"""The memory floor shared by the runtime and the optimizers: the host store (page-locked,
huge-page backed fp32 masters and buffers), flat layouts of a region's parameters, and the
device pool that enforces the budget. It imports nothing else from megatrain but errors."""
