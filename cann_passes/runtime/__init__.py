"""Running compiled graphs: binding a model and optimizer to a graph's inputs and outputs, the
accumulation loop, pipeline stages, sharded state, checkpoints and process groups. The runtime
only binds and runs: compiling is the step driver's (:mod:`cann_passes.step`)."""
