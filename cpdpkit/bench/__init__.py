"""``cpdpkit bench``: benchmark suites over an emulated network, all launched one way.

- :mod:`~cpdpkit.bench.launcher`: the one way a suite launches ranks (a run folder with a spec, a
  result and progress lines; torchrun through :mod:`cpdpkit.launch`).
- suites: :mod:`~cpdpkit.bench.periodic` (the main job), :mod:`~cpdpkit.bench.sharding`,
  :mod:`~cpdpkit.bench.hybrid`; :mod:`~cpdpkit.bench._gpt_rank` is the rank side the two GPT suites share
  and :mod:`~cpdpkit.bench.report` the report they return.
- :mod:`~cpdpkit.bench.data` (data sets) and :mod:`~cpdpkit.bench.models` (models).
"""
