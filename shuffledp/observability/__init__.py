"""What an operator watches: Prometheus metrics of a running service (`metrics`), TensorBoard tracking of a run
(`tracking`) and the terminal's live view of a run (`live`).

May import: everything below the command line, parties included (metrics reads a node's and a shuffler's state).
Nothing below imports this package: a party runs the same with or without it.
"""
