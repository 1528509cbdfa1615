"""Reading a compiled HLO program: its collectives, loops, FLOPs and the rewrites XLA made."""
