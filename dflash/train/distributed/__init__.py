"""Processes of a training job: nodes, the launch agent, process groups, ranks and parallelism."""
