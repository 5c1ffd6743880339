"""Ops that cannot be replayed exactly where pstrain runs a job's code: variable writes that bypass
`assign` and stateful random draws (each run draws anew). `unsupported_ops` finds them in a traced
graph (the step's, worker/replica/replica.py; a dataset's map, worker/input/datasets.py)."""

from __future__ import annotations

import tensorflow as tf

ASSIGN_OPS = {
    "AssignVariableOp",
    "AssignAddVariableOp",
    "AssignSubVariableOp",
    "Assign",
    "AssignAdd",
    "AssignSub",
    "ScatterUpdate",
    "ScatterAdd",
    "ScatterSub",
    "ResourceScatterUpdate",
    "ResourceScatterAdd",
    "ResourceScatterSub",
    "ResourceScatterNdUpdate",
    "ResourceScatterNdAdd",
}
STATEFUL_RANDOM_OPS = {
    "RandomUniform",
    "RandomUniformInt",
    "RandomStandardNormal",
    "TruncatedNormal",
    "ParameterizedTruncatedNormal",
    "RandomGamma",
    "RandomPoisson",
    "RandomPoissonV2",
    "RandomShuffle",
    "Multinomial",
    "StatefulUniform",
    "StatefulUniformInt",
    "StatefulUniformFullInt",
    "StatefulStandardNormalV2",
    "StatefulTruncatedNormal",
    "StatefulRandomBinomial",
    "RngReadAndSkip",
    "RngSkip",
}


def unsupported_ops(graph: tf.Graph) -> list[tuple[str, str]]:
    """(op type, op name) of every variable write or stateful random op in `graph` and its functions."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return [(n.op, n.name) for n in nodes if n.op in ASSIGN_OPS or n.op in STATEFUL_RANDOM_OPS]
