"""graphpass's passes over the joint graph, one per module; ``pipeline.PASSES`` orders them.

Each pass is ``pass_(joint, plan, config)``: it rewrites the joint graph or tags its nodes for
torch's min-cut partitioner, and records every decision a user should see as a typed
``Decision``: on the node it is about (``decisions.record``) or, for the report's notes, on the
shared ``Plan``.
"""
