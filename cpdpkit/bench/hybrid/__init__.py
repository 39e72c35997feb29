"""``cpdpkit bench hybrid``: CPDP across sites over sharded training inside each site, against global
DDP and HSDP, one launched job per strategy.

``suite`` (config, planning, goals, the parent), ``worker`` (one rank).
"""
