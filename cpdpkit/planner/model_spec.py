"""What the planner knows about a model: parameter shapes and the blocks FSDP2 may wrap.

A :class:`ModelSpec` comes from an ``nn.Module`` (:meth:`ModelSpec.from_module`; build it on
the meta device and a 70B model costs no memory), from ``"package.module:factory"``
(:meth:`ModelSpec.from_factory`) or from a preset of public architecture shapes
(:mod:`cpdpkit.planner.presets`, which also holds :func:`~cpdpkit.planner.presets.load_model_spec`,
the one entry point for all of these). Torch is imported only to read a module.

*Blocks* are the smallest modules the planner may give their own ``fully_shard``: the
non-container children of every ``nn.ModuleList`` / ``nn.Sequential`` (recursively), or, when
a model has no container, the root's direct children that hold parameters. Parameters outside
every block belong to the root unit. Neighbouring blocks of one container may be merged into a
unit; a block is never split (FSDP2 shards whole modules).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cpdpkit.planner.config import PlannerError, Record

__all__ = ["ParamSpec", "BlockSpec", "ModelSpec", "ROOT"]

ROOT = -1  # ParamSpec.block of a parameter that belongs to the root unit


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter: fully qualified name, shape, and the index of its block (``ROOT`` = -1)."""

    fqn: str
    shape: tuple[int, ...]
    block: int = ROOT

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise PlannerError(f"parameter {self.fqn!r} has shape {self.shape}; dimensions must be >= 0")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "shape": list(self.shape), "block": self.block}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParamSpec:
        return cls(fqn=data["fqn"], shape=tuple(data["shape"]), block=data.get("block", ROOT))


@dataclass(frozen=True, kw_only=True)
class BlockSpec(Record):
    """A module that may be a ``fully_shard`` unit; ``container`` is its parent container's fqn."""

    fqn: str
    container: str


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model's parameters (in registration order) and its blocks (in execution order)."""

    name: str
    params: tuple[ParamSpec, ...]
    blocks: tuple[BlockSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.params:
            raise PlannerError(f"model {self.name!r} has no parameters; there is nothing to shard")
        for p in self.params:
            if not (p.block == ROOT or 0 <= p.block < len(self.blocks)):
                raise PlannerError(f"parameter {p.fqn!r} names block {p.block}; the model has {len(self.blocks)}")

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": [p.to_dict() for p in self.params],
                "blocks": [b.to_dict() for b in self.blocks]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        return cls(name=data["name"], params=tuple(ParamSpec.from_dict(p) for p in data["params"]),
                   blocks=tuple(BlockSpec.from_dict(b) for b in data.get("blocks", ())))

    @classmethod
    def from_module(cls, module: Any, *, name: str | None = None) -> ModelSpec:
        """Read shapes and blocks from an ``nn.Module`` (meta-device modules are fine)."""
        from torch import nn

        if not isinstance(module, nn.Module):
            raise PlannerError(f"model {module!r} is not a torch.nn.Module; "
                               "pass a module, a preset name or module:factory")
        block_fqns: list[tuple[str, str]] = []
        _collect_blocks(module, "", block_fqns, inside_container=False)
        if not block_fqns:  # no container: the root's children with parameters
            block_fqns = [(child_name, "") for child_name, child in module.named_children()
                          if any(True for _ in child.parameters())]
        blocks = tuple(BlockSpec(fqn=f, container=c) for f, c in block_fqns)
        owner: dict[int, int] = {}
        for i, b in enumerate(blocks):
            for p in module.get_submodule(b.fqn).parameters():
                owner.setdefault(id(p), i)
        params = tuple(ParamSpec(fqn=fqn, shape=tuple(p.shape), block=owner.get(id(p), ROOT))
                       for fqn, p in module.named_parameters())
        return cls(name=name or type(module).__name__, params=params, blocks=blocks)

    @classmethod
    def from_factory(cls, path: str) -> ModelSpec:
        """Read the module ``"package.module:factory"`` builds (called with no arguments).

        The factory runs under ``torch.device("meta")``, so it allocates nothing.
        """
        module_name, _, attr = path.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise PlannerError(f"model {path!r} cannot be loaded ({exc}); check 'package.module:factory'") from None
        import torch

        with torch.device("meta"):
            module = factory()
        return cls.from_module(module, name=path)


def _is_container(module: Any) -> bool:
    from torch import nn

    return isinstance(module, (nn.ModuleList, nn.Sequential))


def _collect_blocks(module: Any, prefix: str, out: list[tuple[str, str]], *, inside_container: bool) -> None:
    for child_name, child in module.named_children():
        fqn = f"{prefix}.{child_name}" if prefix else child_name
        has_params = any(True for _ in child.parameters())
        if _is_container(child):
            _collect_blocks(child, fqn, out, inside_container=True)
        elif inside_container or _is_container(module):
            if has_params:
                out.append((fqn, prefix))
        elif has_params:
            _collect_blocks(child, fqn, out, inside_container=False)
