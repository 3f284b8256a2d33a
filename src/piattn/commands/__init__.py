"""The command front-ends of `piattn` (train, eval, generate, reach, demo): the top of the import graph.

Each module has `add_arguments(parser)` and `run(args) -> int`; `piattn.cli` dispatches to them. Libraries
(ops, layers, models, decoding, tasks, train) hold no command-line code.
"""
