"""The main job, ``cpdpkit bench``: every synchronisation strategy (DDP, torch's LocalSGD, ours:
LocalSGD, SlowMo, CPDP, overlapped and auto-K) trains one workload, one launched job per
(topology, strategy, period, seed); seeds are aggregated with paired confidence intervals.

``config`` (:class:`BenchConfig`, :class:`RunSpec`), ``presets``, ``faults`` (``--inject-fault``),
``runner`` (the parent), ``worker`` (one rank), ``strategies`` (the runners a rank trains with),
``report`` (the aggregate over seeds), ``goals`` (the overlap and auto-K goals).
"""
