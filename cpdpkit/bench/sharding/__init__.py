"""``cpdpkit bench sharding``: the sharding paper's comparison on a small GPT, torch's FSDP2, HSDP and
ZeRO-1 peers against the planner's executors, one launched job per strategy.

``suite`` (config, planning, goals, the parent), ``worker`` (one rank), ``zero_peers`` (torch's
ZeroRedundancyOptimizer peers).
"""
