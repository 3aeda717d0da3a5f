"""graphpass's passes over the joint graph, one per module; ``pipeline.PASSES`` orders them.

Each pass is ``pass_(joint, config, log)``: it rewrites the joint graph or tags its nodes for
torch's min-cut partitioner, and writes a line to ``log`` for every decision a user should see.
"""
