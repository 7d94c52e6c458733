"""The plan: a step's problem in numbers, the cost and memory models, the search for the
fastest schedule that fits the budget, its simulation and an independent validator.

Pure by contract: nothing here imports megatrain.compiler, megatrain.runtime or
megatrain.optim (tests/test_layers.py checks it). The compiler reads a graph into a
planner Problem and materialises the chosen schedule; the runtime and the optimizer read
rates and costs from here.

Imports go one way: problem (the input) <- program (order and memory) <- simulate (time)
<- events (schedule to FX events) <- search (the planner, `plan_step`); costs, validate and
timeline sit beside them.
"""
