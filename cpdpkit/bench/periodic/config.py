"""Configuration of ``cpdpkit bench`` (the whole comparison) and of one run in it.

Everything is validated here, before any process starts: a bad option costs nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cpdpkit._values import is_int, refuse_nonfinite
from cpdpkit.bench.data import DATASETS, find_cifar100
from cpdpkit.bench.data.augment import IMAGE_DATASETS
from cpdpkit.bench.data.dataset import check_dataset_packages
from cpdpkit.bench.data.image_folders import find_tiny_imagenet
from cpdpkit.bench.data.mnist1d import check_mnist1d
from cpdpkit.bench.data.text import check_corpus
from cpdpkit.bench.models import check_model_available
from cpdpkit.bench.periodic.faults import CHECKPOINT_EVERY, parse_fault
from cpdpkit.errors import ConfigError
from cpdpkit.sync.config import OUTER_OPTIMIZERS, STATE_POLICIES, SyncConfig, is_torch_optimizer_name, slowmo_beta_for
from cpdpkit.topology import PRESETS

__all__ = ["BENCH_STRATEGIES", "COMPRESSIBLE", "DEFAULT_STRATEGIES", "LR_SCHEDULES", "OUTER_STEP", "PERIODIC",
           "SYNC_KEYS",
           "BenchConfig", "RunSpec", "slowmo_beta_for"]

# every strategy the bench knows; the default runs all but slowmo-overlap and cpdp-step-then-average
# (cpdp with cpdp_order="step-then-average": the synchronous step, then the average)
BENCH_STRATEGIES = ("ddp", "localsgd-torch", "localsgd", "slowmo", "cpdp", "cpdp-overlap", "cpdp-auto",
                    "slowmo-overlap", "cpdp-step-then-average")
DEFAULT_STRATEGIES = BENCH_STRATEGIES[:-2]
# run at every K of --periods; cpdp-auto picks its own K (period None)
PERIODIC = ("localsgd-torch", "localsgd", "slowmo", "cpdp", "cpdp-overlap", "slowmo-overlap",
            "cpdp-step-then-average")
# ours at a fixed K: swept over --compression and (but for cpdp-step-then-average) split into --fragments
# (cpdp-auto's controller rides in an uncompressed average; ddp and localsgd-torch are torch's own)
COMPRESSIBLE = ("localsgd", "slowmo", "cpdp", "cpdp-overlap", "slowmo-overlap", "cpdp-step-then-average")
FRAGMENTABLE = COMPRESSIBLE[:-1]  # the step-then-average order all-reduces every gradient at once
LR_SCHEDULES = ("constant", "cosine", "step")  # built by cpdpkit.bench.periodic.strategies.build_lr_scheduler
# the strategies with an outer step: swept over --slowmo-momentum and --outer-lr
OUTER_STEP = ("slowmo", "cpdp", "cpdp-overlap", "cpdp-auto", "slowmo-overlap", "cpdp-step-then-average")

# The most runs one bench command may hold (each a launched job): a bound, checked before any is built.
MAX_RUNS = 10_000

# The SyncConfig fields a run's spec carries (as these top-level keys of spec.json and of each result's
# "spec", docs/json.md); the strategy, period, τ and cpdp_order follow from the bench strategy's name.
SYNC_KEYS = ("slowmo_momentum", "slowmo_lr", "warmup_steps", "optimizer_state", "target_exposed_frac", "k_min",
             "k_max", "max_divergence", "outer_optimizer", "outer_lr", "compression", "fragments")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One strategy at one period and one seed: what a launched rank trains.

    ``sync`` is :attr:`BenchConfig.sync` at this run's swept point (β, outer lr), passed to the rank as it
    is; :func:`cpdpkit.bench.periodic.strategies.run_sync_config` sets the strategy's own part.
    """

    strategy: str
    period: int | None
    seed: int
    model: str
    dataset: str
    data_dir: str | None
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    quick: bool
    sync: SyncConfig = field(default_factory=SyncConfig)
    profile_dir: str | None = None
    # BenchConfig always passes these; the defaults keep older spec.json files readable
    lr_schedule: str = "constant"
    augment: bool = False
    max_images: int | None = None
    overlap_steps: int = 3  # τ of the -overlap strategies (the others reconcile blocking)
    topology: str | None = None  # None: the config's --topology (spec.json files from before --topologies)
    fault: str | None = None  # --inject-fault (cpdpkit.bench.periodic.faults); None: no fault
    checkpoint_every: int | None = None  # checkpoint into RUN_DIR/ckpt every N steps (None: no checkpoints)
    variant: str | None = None  # the point of a swept --slowmo-momentum / --outer-lr ("β=0.2"); None: no sweep

    @property
    def label(self) -> str:
        base = self.strategy if self.period is None else f"{self.strategy} K={self.period}"
        return base if self.variant is None else f"{base} {self.variant}"

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON: ``sync``'s :data:`SYNC_KEYS` at the top level, as before it was one object."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sync"}
        return {**out, **{key: getattr(self.sync, key) for key in SYNC_KEYS}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        """From :meth:`to_dict` (a key missing, as in older spec.json files: SyncConfig's default)."""
        rest = {k: v for k, v in data.items() if k not in SYNC_KEYS}
        return cls(**rest, sync=SyncConfig(**{k: data[k] for k in SYNC_KEYS if k in data}))


# The data sets only one model reads, and the one-line refusals of a mismatch either way:
# (data set, its model, the data set's check, another model on it, the model on another data set).
_ONE_MODEL_DATA: tuple[tuple[str, str, Callable[[], None], str, str], ...] = (
    ("mnist1d", "cnn1d", check_mnist1d,
     "--model {model} does not read 1-D sequences, which --dataset mnist1d holds: use --model cnn1d "
     "(or --preset mnist1d)",
     "--model cnn1d reads 1-D sequences, but --dataset {dataset} holds none: use --dataset mnist1d "
     "(or --preset mnist1d)"),
    ("stdlib-text", "char-mlp", check_corpus,
     "--model {model} needs images, but --dataset stdlib-text holds character ids: use --model char-mlp "
     "(or an image data set such as --dataset digits)",
     "--model char-mlp reads character ids, but --dataset {dataset} holds images: use --model cnn "
     "(or --dataset stdlib-text)"),
)


def _positive(name: str, value: Any, fix: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}: {fix}")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """The comparison ``cpdpkit bench`` runs (defaults: the CPDP paper's setting, on stdlib-text)."""

    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    periods: tuple[int, ...] = (2, 4)
    model: str = "char-mlp"  # the default workload (bench.data.text); digits: --model cnn --epochs 30 --batch-size 32
    dataset: str = "stdlib-text"
    data_dir: str | None = None
    epochs: int = 4
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.9
    # SlowMo's β: one value, a tuple (swept like periods), or None: by replicas (cpdpkit.sync.slowmo_beta_for)
    slowmo_momentum: float | tuple[float, ...] | None = None
    slowmo_lr: float = 1.0
    outer_optimizer: str = "slowmo"  # slowmo | diloco | a torch.optim class name (slowmo and cpdp)
    # of an outer optimizer other than slowmo (None: diloco 0.7, a class 1.0); a tuple is swept
    outer_lr: float | tuple[float, ...] | None = None
    # the codecs of the COMPRESSIBLE strategies' reconciliations, swept like periods (the others: "none")
    compression: tuple[str, ...] = ("none",)
    fragments: int = 1  # the COMPRESSIBLE strategies' model in this many fragments, reconciled in turn
    warmup_steps: int = 0
    optimizer_state: str = "keep"
    lr_schedule: str = "constant"
    world_size: int = 2
    topology: str = "wan"
    seeds: int = 1
    quick: bool = False
    profile_dir: str | None = None
    augment: bool = False  # random crop (padding 4) + horizontal flip of training batches
    max_images: int | None = None  # use at most this many training and this many test images
    overlap_steps: int = 3  # τ of cpdp-overlap and slowmo-overlap: the average lands τ steps after its launch
    target_exposed_frac: float = 0.05  # cpdp-auto: the share of step time its controller lets sync expose
    k_min: int = 1  # cpdp-auto: the range of K its controller picks from
    k_max: int = 8
    max_divergence: float | None = None  # cpdp-auto: cap on the ranks' parameter divergence (None: no cap)
    topologies: tuple[str, ...] | None = None  # run the whole comparison once per preset (else: topology)
    inject_fault: str | None = None  # kill:rank=R:step=S: each run killed once, restarted, compared (bench.faults)
    # The options above that PeriodicSyncOptimizer takes, validated (at the first β and outer lr): each run's
    # spec holds it at its own swept point and the rank passes it on (not an argument: built from the options)
    sync: SyncConfig = field(init=False, repr=False, compare=False, default_factory=SyncConfig)

    def __post_init__(self) -> None:
        refuse_nonfinite(self, ConfigError, options=True)
        for s in self.strategies:
            if s not in BENCH_STRATEGIES:
                raise ConfigError(
                    f"unknown strategy {s!r}: choose from {', '.join(BENCH_STRATEGIES)}"
                )
        if not self.strategies:
            raise ConfigError("--strategies is empty: name at least one, e.g. --strategies ddp,cpdp")
        for k in self.periods:
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ConfigError(f"period K must be an integer >= 1, got {k!r}: e.g. --periods 2,4")
        if any(s in PERIODIC for s in self.strategies) and not self.periods:
            raise ConfigError("--periods is empty: give at least one K, e.g. --periods 4")
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}: choose one of {', '.join(DATASETS)}")
        check_dataset_packages(self.dataset)  # scikit-learn, pillow, mnist1d: the extra to install, in one line
        if self.dataset == "cifar100":
            if self.data_dir is None:
                raise ConfigError("--dataset cifar100 needs --data-dir: the folder holding cifar-100-python/")
            find_cifar100(self.data_dir)
        if self.dataset == "tinyimagenet":
            find_tiny_imagenet(self.data_dir)  # names --data-dir and the layouts it reads
        if self.max_images is not None and (isinstance(self.max_images, bool) or not isinstance(self.max_images, int)
                                            or self.max_images < 1):
            raise ConfigError(f"max_images must be an integer >= 1 or None, got {self.max_images!r}: e.g. 64")
        if self.augment and self.dataset not in (*IMAGE_DATASETS, "mnist1d"):
            raise ConfigError(f"--augment crops and flips images, and --dataset {self.dataset} holds none: "
                              "pass --no-augment")
        check_model_available(self.model)
        self._check_model_fits_data()
        for name, value, fix in (
            ("--epochs", self.epochs, "e.g. --epochs 30"),
            ("--batch-size", self.batch_size, "e.g. --batch-size 32"),
            ("--lr", self.lr, "the paper's setting is --lr 0.1"),
            ("--world-size", self.world_size, "e.g. --world-size 2"),
            ("--seeds", self.seeds, "e.g. --seeds 3"),
        ):
            _positive(name, value, fix)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum!r}: e.g. --momentum 0.9")
        self._check_sync_options()
        self._check_overlap_and_auto()
        self._check_topologies()
        if self.inject_fault is not None:
            parse_fault(self.inject_fault, world_size=self.world_size if is_int(self.world_size) else None)
        self._check_run_count()
        # SyncConfig's options by their own names (SYNC_KEYS), the swept two at their first point
        options = {key: getattr(self, key) for key in SYNC_KEYS}
        object.__setattr__(self, "sync", SyncConfig(**{**options, "slowmo_momentum": self.betas[0],
                                                        "outer_lr": self.outer_lrs[0], "compression": "none",
                                                        "fragments": 1}))

    def _check_run_count(self) -> None:
        """Refuse more than :data:`MAX_RUNS` runs before :meth:`runs` builds them (each run is a launched job of
        seconds at least, so more is days of work, and a huge ``--seeds`` would exhaust memory building the list)."""
        per_seed = sum((len(self.periods) if strategy in PERIODIC else 1)
                       * (len(self.betas) * len(self.outer_lrs) if strategy in OUTER_STEP else 1)
                       * len(self._codecs(strategy))
                       for strategy in self.strategies)
        count = len(self.topology_names) * self.seeds * per_seed
        if count > MAX_RUNS:
            raise ConfigError(f"--seeds {self.seeds} with these strategies, periods and topologies makes {count} "
                              f"runs, more than {MAX_RUNS}: pass fewer --seeds, --strategies or --periods")

    @property
    def topology_names(self) -> tuple[str, ...]:
        """The topologies the comparison runs on, in order: ``topologies``, else ``(topology,)``."""
        return self.topologies if self.topologies is not None else (self.topology,)

    def _check_overlap_and_auto(self) -> None:
        if not is_int(self.overlap_steps) or self.overlap_steps < 1:
            raise ConfigError(f"--overlap-steps must be an integer >= 1, got {self.overlap_steps!r}: the steps an "
                              "overlapped average may run behind, e.g. --overlap-steps 2")
        overlapped = [s for s in self.strategies if s.endswith("-overlap")]
        if overlapped and self.optimizer_state == "average":
            raise ConfigError(f"--optimizer-state average cannot be applied late, as {', '.join(overlapped)} would: "
                              "use --optimizer-state keep, or leave the -overlap strategies out of --strategies")
        frac = self.target_exposed_frac
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
            raise ConfigError(f"--target-exposed-frac must be in (0, 1), got {frac!r}: the share of step time "
                              "cpdp-auto may leave exposed to sync, e.g. --target-exposed-frac 0.1")
        for flag, value in (("--k-min", self.k_min), ("--k-max", self.k_max)):
            if not is_int(value) or value < 1:
                raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}: e.g. --k-min 1 --k-max 8")
        if self.k_min > self.k_max:
            raise ConfigError(f"--k-min {self.k_min} is above --k-max {self.k_max}: give k-min <= k-max, "
                              "e.g. --k-min 1 --k-max 8")
        if self.max_divergence is not None:
            _positive("--max-divergence", self.max_divergence, "e.g. --max-divergence 0.01, or leave it out for no cap")

    def _check_topologies(self) -> None:
        if self.topologies is None:
            return
        if not self.topologies:
            raise ConfigError("--topologies is empty: name at least one preset, e.g. --topologies lan,wan")
        for name in self.topologies:
            if name not in PRESETS:
                raise ConfigError(f"unknown topology {name!r} in --topologies: choose from {', '.join(PRESETS)} "
                                  "(a TOML file: --topology FILE)")
        repeated = sorted({name for name in self.topologies if self.topologies.count(name) > 1})
        if repeated:
            raise ConfigError(f"--topologies names {', '.join(repeated)} more than once: list each topology once")

    def _check_model_fits_data(self) -> None:
        """Character ids, 1-D sequences and images need different models: refuse a mismatch before any launch."""
        for dataset, model, check, other_model, other_data in _ONE_MODEL_DATA:
            if self.dataset == dataset:
                check()  # not installed, or a missing corpus file: one line now, before any rank starts
                if self.model != model:
                    raise ConfigError(other_model.format(model=self.model))
                return
            if self.model == model:
                raise ConfigError(other_data.format(dataset=self.dataset))

    @property
    def betas(self) -> tuple[float, ...]:
        """SlowMo's β values to run: the given ones, else the one for ``world_size`` replicas."""
        if self.slowmo_momentum is None:
            return (slowmo_beta_for(self.world_size),)
        return self.slowmo_momentum if isinstance(self.slowmo_momentum, tuple) else (self.slowmo_momentum,)

    @property
    def outer_lrs(self) -> tuple[float | None, ...]:
        return self.outer_lr if isinstance(self.outer_lr, tuple) else (self.outer_lr,)

    def _codecs(self, strategy: str) -> tuple[str, ...]:
        return self.compression if strategy in COMPRESSIBLE else ("none",)

    def _check_compression(self) -> None:
        from cpdpkit.sync._codec import parse_compression

        if isinstance(self.compression, str) or not isinstance(self.compression, tuple) or not self.compression:
            raise ConfigError(f"--compression must name at least one codec, got {self.compression!r}: e.g. "
                              "--compression none,int8,topk:0.02")
        for codec in self.compression:
            try:
                parse_compression(codec)
            except ConfigError as exc:
                raise ConfigError(f"--compression: {exc}") from None
        repeated = sorted({c for c in self.compression if self.compression.count(c) > 1})
        if repeated:
            raise ConfigError(f"--compression names {', '.join(repeated)} more than once: list each codec once")
        if not is_int(self.fragments) or self.fragments < 1:
            raise ConfigError(f"--fragments must be an integer >= 1, got {self.fragments!r}: e.g. --fragments 4 "
                              "(1: the whole model at once)")
        if self.fragments > 1 and self.optimizer_state != "keep":
            raise ConfigError(f"--fragments {self.fragments} with --optimizer-state {self.optimizer_state}: a policy "
                              "on the whole optimizer cannot follow fragments; use --optimizer-state keep or "
                              "--fragments 1")

    def _check_sync_options(self) -> None:
        self._check_compression()
        for beta in self.betas:
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
                raise ConfigError(f"--slowmo-momentum must be in [0, 1), got {beta!r}: SlowMo's β, e.g. "
                                  "--slowmo-momentum 0.2 (or a list to sweep: 0,0.2,0.5)")
        if not self.betas or not self.outer_lrs:
            raise ConfigError("--slowmo-momentum / --outer-lr is empty: give a value, or leave it out")
        _positive("--slowmo-lr", self.slowmo_lr, "e.g. --slowmo-lr 1.0 (SlowMo's default α)")
        name = self.outer_optimizer
        if not isinstance(name, str) or (name not in OUTER_OPTIMIZERS and not is_torch_optimizer_name(name)):
            raise ConfigError(f"--outer-optimizer {name!r} is not a torch optimizer: pass slowmo, diloco or the name "
                              "of a torch.optim.Optimizer class, e.g. --outer-optimizer SGD")
        if self.outer_lr is not None:
            if name == "slowmo":
                raise ConfigError("--outer-lr with --outer-optimizer slowmo: SlowMo's outer LR is --slowmo-lr; "
                                  "pass that, or --outer-optimizer diloco")
            for value in self.outer_lrs:
                _positive("--outer-lr", value, "e.g. --outer-lr 0.7 (DiLoCo's), or a list to sweep: 0.5,0.7")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}: "
                              "e.g. --warmup-steps 0 for no warm-up")
        for flag, value, choices, example in (
            ("--optimizer-state", self.optimizer_state, STATE_POLICIES, "keep"),
            ("--lr-schedule", self.lr_schedule, LR_SCHEDULES, "cosine"),
        ):
            if value not in choices:
                raise ConfigError(f"{flag} {value!r} is not one of {', '.join(choices)}: e.g. {flag} {example}")

    def runs(self) -> list[RunSpec]:
        """Every (topology, seed, strategy, period, outer point) to run, topology by topology, ddp first (the
        baseline); the strategies with an outer step (:data:`OUTER_STEP`) run at every swept β and outer lr."""
        return [self._spec(topology, seed, strategy, period, beta, outer_lr, codec)
                for topology in self.topology_names
                for seed in range(self.seeds)
                for strategy in self.strategies
                for period in (self.periods if strategy in PERIODIC else (None,))
                for codec in self._codecs(strategy)
                for beta in (self.betas if strategy in OUTER_STEP else self.betas[:1])
                for outer_lr in (self.outer_lrs if strategy in OUTER_STEP else self.outer_lrs[:1])]

    def _variant(self, strategy: str, beta: float, outer_lr: float | None, codec: str) -> str | None:
        """The run's point beyond strategy and K: a swept β / outer lr, a codec, a fragment count."""
        parts = []
        if strategy in OUTER_STEP:
            parts += ([f"β={beta:g}"] if len(self.betas) > 1 else []) + (
                [f"outer lr={outer_lr:g}"] if len(self.outer_lrs) > 1 and outer_lr is not None else [])
        if strategy in COMPRESSIBLE:
            parts += [codec] if codec != "none" else []
        if strategy in FRAGMENTABLE and self.fragments > 1:
            parts.append(f"fragments={self.fragments}")
        return " ".join(parts) or None

    def _spec(self, topology: str, seed: int, strategy: str, period: int | None, beta: float,
              outer_lr: float | None, codec: str) -> RunSpec:
        profile_dir = self.profile_dir
        if profile_dir is not None and len(self.topology_names) > 1:  # DIR/<topology>/<strategy>-k<K>/
            profile_dir = f"{profile_dir.rstrip('/')}/{topology}"
        return RunSpec(strategy=strategy, period=period, seed=seed, model=self.model,
                       dataset=self.dataset, data_dir=self.data_dir,
                       epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                       momentum=self.momentum, variant=self._variant(strategy, beta, outer_lr, codec),
                       sync=dataclasses.replace(self.sync, slowmo_momentum=beta, outer_lr=outer_lr, compression=codec,
                                                fragments=self.fragments if strategy in FRAGMENTABLE else 1),
                       quick=self.quick, profile_dir=profile_dir, lr_schedule=self.lr_schedule, augment=self.augment,
                       max_images=self.max_images, overlap_steps=self.overlap_steps, topology=topology,
                       fault=self.inject_fault,
                       checkpoint_every=CHECKPOINT_EVERY if self.inject_fault is not None else None)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sync"}
        out["strategies"], out["periods"] = list(self.strategies), list(self.periods)
        out["slowmo_momentum"] = list(self.betas) if len(self.betas) > 1 else self.betas[0]
        out["outer_lr"] = list(self.outer_lrs) if len(self.outer_lrs) > 1 else self.outer_lrs[0]
        out["topologies"] = None if self.topologies is None else list(self.topologies)
        out["compression"] = list(self.compression)
        return out
