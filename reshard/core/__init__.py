"""The core: the spec language, its resolution into fragments, topologies, box geometry and the planner.

Pure computation over metadata: no file I/O beyond reading spec files, and no torch.
"""
