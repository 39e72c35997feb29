"""What :class:`~cpdpkit.sync.PeriodicSyncOptimizer` checks before its first collective.

A user mistake must end in one line naming the value and the fix, never in a peer hanging on a
collective this rank will not join: every check here is local (no communication), and the
optimizer runs them all before it talks to anyone. Loading a checkpoint is checked here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cpdpkit.contracts import SyncedExecutor
from cpdpkit.errors import ConfigError, DistributedSetupError
from cpdpkit.sync._comm import group_ranks
from cpdpkit.sync._sharded import check_replica_layout, check_sharded_model
from cpdpkit.sync.config import SyncConfig
from cpdpkit.topology import Topology

__all__ = ["STATE_VERSION", "is_executor", "resolve_config", "validate_objects", "validate_groups",
           "validate_sharded", "validate_executor", "check_params_in_model", "split_checkpoint",
           "check_clip_args"]

# 1: {"inner": <inner state dict>, "cpdpkit": ...}; 2: torch's standard dict plus "cpdpkit";
# 3: "cpdpkit" also holds the schedule, the controller's decisions and a reconciliation in flight;
# 4: the config holds cpdp_order and "cpdpkit" the next synchronous step ("sync_step"). A cpdp
# checkpoint of versions 1-3 was written by cpdp's step-then-average order.
# 5: "cpdpkit" holds the compression residuals ("residuals", None when uncompressed), cpdp's synchronous-step
# gradient residuals ("grad_residuals") and, with fragments=F > 1, each fragment's own state ("fragments").
STATE_VERSION = 5
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SyncConfig))
_EXECUTOR_FIX = ("build the executor on one site's sub-mesh: mesh = init_device_mesh(device, (num_sites, R, S), "
                 "mesh_dim_names=('site', 'replicate', 'shard')), TwoStageExecutor(..., mesh=mesh['replicate', "
                 "'shard']), and pass group=mesh['site'].get_group()")


def is_executor(model: Any) -> bool:
    """A slice executor (TwoStageExecutor, PartialShardExecutor): a :class:`~cpdpkit.contracts.SyncedExecutor`
    (sync does not import cpdpkit.shard, which sits above it)."""
    return not isinstance(model, nn.Module) and isinstance(model, SyncedExecutor)


def resolve_config(config: SyncConfig | None, options: dict[str, Any]) -> SyncConfig:
    """``config=`` or keyword options named like SyncConfig's fields, never both: the defaults
    live only in SyncConfig, and refusing the mix leaves no doubt about which value wins."""
    unknown = [name for name in options if name not in _CONFIG_FIELDS]
    if unknown:
        raise ConfigError(
            f"unknown keyword {', '.join(map(repr, unknown))} for PeriodicSyncOptimizer: "
            f"known SyncConfig fields are {', '.join(_CONFIG_FIELDS)}"
        )
    if config is None:
        return SyncConfig(**options)
    if not isinstance(config, SyncConfig):
        raise TypeError(
            f"config must be a SyncConfig, got {type(config).__name__}: "
            "pass config=cpdpkit.sync.SyncConfig(...)"
        )
    if options:
        given = ", ".join(f"{name}=..." for name in options)
        raise ConfigError(
            f"config= given together with {', '.join(options)}: pass "
            f"config=dataclasses.replace(config, {given}), or the keywords without config="
        )
    return config


def _check_group(group: Any, what: str) -> None:
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise DistributedSetupError(
            f"this rank ({dist.get_rank()}) is not a member of the {what} passed to "
            f"PeriodicSyncOptimizer: pass a group created with this rank in its ranks"
        )


def validate_objects(optimizer: Any, model: Any, anchor_dtype: Any, *, wrapper: type) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}: "
            "wrap e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    if isinstance(optimizer, wrapper):
        raise ConfigError("optimizer is already a PeriodicSyncOptimizer: wrap the inner one once")
    if not isinstance(model, nn.Module) and not is_executor(model):
        raise TypeError(
            f"model must be an nn.Module or a TwoStageExecutor, got {type(model).__name__}: "
            "pass model=<your module>"
        )
    if anchor_dtype is not None and not (
        isinstance(anchor_dtype, torch.dtype) and anchor_dtype.is_floating_point
    ):
        raise ConfigError(
            f"anchor_dtype must be a floating torch.dtype, got {anchor_dtype!r}: "
            "pass anchor_dtype=torch.float32"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedSetupError(
            "torch.distributed is not initialised: call cpdpkit.init_distributed() or "
            "torch.distributed.init_process_group() before creating PeriodicSyncOptimizer"
        )


def validate_groups(config: SyncConfig, model: Any, group: Any, fast: Any, slow: Any) -> None:
    _check_group(group, "group")
    if fast is not None:
        _check_group(fast, "fast_group")
        if isinstance(model, DistributedDataParallel):
            raise ConfigError(
                "fast_group with a DDP-wrapped model: DDP already all-reduces over its own "
                "group; pass the plain module and let fast_group do the intra-node sync"
            )
    if slow is not None:
        if fast is None:
            raise ConfigError("slow_group is set without fast_group: pass both, or use group=")
        _check_group(slow, "slow_group")
    if fast is not None and config.auto:
        raise ConfigError(
            "period='auto' with fast_group: each slow group would choose its own K while "
            "reconciliation steps all-reduce gradients over the whole group; pass a fixed "
            "period, or group= without fast_group"
        )
    if isinstance(model, DistributedDataParallel):
        ddp_ranks = group_ranks(model.process_group)
        if ddp_ranks != group_ranks(group):
            raise ConfigError(
                f"the DDP model's process group has ranks {ddp_ranks} but group has "
                f"{group_ranks(group)}: pass group=<the DDP model's process group>"
            )


def validate_sharded(config: SyncConfig, model: nn.Module, params: list[torch.Tensor], group: Any, fast: Any,
                     topology: Topology | None) -> None:
    """An FSDP2 model: sharded inside the replica, ``group`` across replicas (:mod:`cpdpkit.sync._sharded`)."""
    if fast is not None:
        raise ConfigError("fast_group with an FSDP2-sharded model: FSDP2's shard group already synchronises "
                          "inside the replica on every step; pass group=<the replicate group> only")
    if config.auto:
        raise ConfigError("period='auto' with an FSDP2-sharded model: each shard's replicate group would choose "
                          "its own K; pass a fixed period")
    check_sharded_model(model, params, group, topology)


def validate_executor(config: SyncConfig, ex: SyncedExecutor, optimizer: Any, group: Any, fast: Any,
                      topology: Topology | None) -> None:
    """A slice executor: its mesh is one replica (a site), ``group`` crosses replicas."""
    name = type(ex).__name__
    if optimizer is not ex.optimizer:
        raise ConfigError(f"optimizer is not the {name}'s own: pass PeriodicSyncOptimizer(executor.optimizer, "
                          "model=executor, group=<the replicate group>, ...)")
    if fast is not None:
        raise ConfigError(f"fast_group with a {name}: its mesh already synchronises inside the replica on every "
                          "step; pass group=<the replicate group> only")
    if config.auto:
        raise ConfigError(f"period='auto' with a {name}: pass a fixed period")
    ranks = [int(r) for r in ex.mesh.mesh.flatten().tolist()]
    check_replica_layout(ranks, group, topology, what=f"{name}'s mesh is", fix=_EXECUTOR_FIX)


def check_params_in_model(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    in_model = {id(p) for p in model.parameters()}
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            if id(p) not in in_model:
                raise ConfigError(
                    f"parameter {pi} of param group {gi} (shape {tuple(p.shape)}) is not a "
                    "parameter of model: build the optimizer from model.parameters()"
                )


def split_checkpoint(state_dict: dict[str, Any], config: SyncConfig, layout: list[list[int]]) -> tuple[dict, dict]:
    """(the wrapper's own state, the inner's standard dict), after checking they fit."""
    if "cpdpkit" not in state_dict:
        raise ConfigError(
            "state_dict has no 'cpdpkit' key: pass what PeriodicSyncOptimizer.state_dict() "
            "returned (to load the inner optimizer alone, use opt.optim.load_state_dict)"
        )
    own = state_dict["cpdpkit"]
    version = own.get("version")
    if version == 1:  # written before the wrapper used torch's standard layout
        inner_state = state_dict["inner"]
    elif version in (2, 3, 4, STATE_VERSION):
        inner_state = {k: v for k, v in state_dict.items() if k != "cpdpkit"}
    else:
        raise ConfigError(
            f"checkpoint has cpdpkit state version {version!r}, this cpdpkit reads 1 to "
            f"{STATE_VERSION}: load it with the cpdpkit version that saved it"
        )
    saved = SyncConfig.from_dict(own["config"])
    if saved.strategy != config.strategy:
        raise ConfigError(
            f"checkpoint was saved with strategy {saved.strategy!r}, this optimizer uses "
            f"{config.strategy!r}: construct it with strategy={saved.strategy!r}"
        )
    saved_order = own["config"].get("cpdp_order", "step-then-average")  # versions 1-3: the old order
    if config.strategy == "cpdp" and saved_order != config.cpdp_order:
        raise ConfigError(
            f"checkpoint was saved by cpdp with cpdp_order={saved_order!r}, this optimizer uses "
            f"{config.cpdp_order!r}: construct it with cpdp_order={saved_order!r} to resume it"
        )
    if own.get("in_flight") is not None and not config.overlap_steps:
        raise ConfigError(
            f"checkpoint holds a reconciliation in flight (saved with overlap_steps="
            f"{saved.overlap_steps}), this optimizer reconciles blocking: construct it with "
            f"overlap_steps={saved.overlap_steps}"
        )
    saved_compression = own["config"].get("compression", "none")  # versions 1-4: uncompressed
    if saved_compression != config.compression and own.get("residuals") is not None:
        raise ConfigError(
            f"checkpoint holds compression={saved_compression!r} residuals, this optimizer uses "
            f"compression={config.compression!r}: construct it with compression={saved_compression!r} to resume it"
        )
    saved_fragments = int(own["config"].get("fragments", 1))  # versions 1-5 before fragments: 1
    if saved_fragments != config.fragments:
        raise ConfigError(
            f"checkpoint was saved with fragments={saved_fragments}, this optimizer uses fragments="
            f"{config.fragments}: construct it with fragments={saved_fragments} to resume it"
        )
    if own["layout"] != layout:
        raise ConfigError(
            "checkpoint parameter layout differs from this optimizer's: load a checkpoint "
            "saved with the same model and param groups"
        )
    return own, inner_state


def check_clip_args(max_norm: Any, norm_type: Any) -> None:
    """``clip_grad_norm_``'s arguments, before any collective: a positive ``max_norm`` and ``norm_type``."""
    for name, value, example in (("max_norm", max_norm, "1.0"), ("norm_type", norm_type, "2.0, or float('inf')")):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not value > 0:  # NaN fails ``> 0``
            raise ConfigError(f"clip_grad_norm_ got {name}={value!r}: pass a positive number (e.g. {example})")
