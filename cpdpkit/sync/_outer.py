"""The outer step of ``slowmo`` and ``cpdp``: an optimizer on the pseudo-gradient ``anchor − average``.

``outer_optimizer`` (:class:`~cpdpkit.sync.SyncConfig`):

* ``"slowmo"`` (the default): SlowMo's update with β = ``slowmo_momentum`` and α = ``slowmo_lr``,
  normalised by each param group's current lr γ: ``u ← β·u + (x0 − x̄)/γ; x0 ← x0 − α·γ·u``.
  With a constant γ this is ``torch.optim.SGD(lr=α, momentum=β)`` on ``x0 − x̄`` (its momentum
  buffer is ``γ·u``): ``tests/test_sync_outer.py`` checks the two against each other.
* ``"diloco"``: DiLoCo's outer step, ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)``
  (``outer_lr`` and ``outer_momentum`` override the two numbers).
* the name of any ``torch.optim.Optimizer`` class (``"SGD"``, ``"Adam"``, ...): that class with
  ``lr=outer_lr`` (default 1.0) and, when given, ``momentum=outer_momentum``.

A torch outer optimizer steps one tensor per flat segment of the anchor (this rank's shard of it
with FSDP2 or a slice executor, so its state is shard-sized like SlowMo's momentum): the tensor
takes the anchor's value, its ``.grad`` the pseudo-gradient, and after ``step()`` its value is the new
anchor and the reconciled parameters. Its state saves as ``{"state": [per tensor], "param_groups":
[...without "params"]}`` under the wrapper's ``"outer"`` key and resumes bit-identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cpdpkit.errors import ConfigError
from cpdpkit.sync._flat import SegmentedParameters
from cpdpkit.sync.config import SyncConfig

__all__ = ["OuterStep", "DILOCO_LR", "DILOCO_MOMENTUM"]

DILOCO_LR, DILOCO_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD (Douillard et al. 2023)


class OuterStep:
    """Applies ``config.outer_optimizer`` to the averages of a reconciliation (module docstring)."""

    def __init__(self, config: SyncConfig, flat: SegmentedParameters) -> None:
        self.config, self._flat = config, flat
        self._optim: torch.optim.Optimizer | None = None
        self._params: list[torch.Tensor] = []

    @property
    def is_slowmo(self) -> bool:
        return self.config.outer_optimizer == "slowmo"

    def _build(self) -> torch.optim.Optimizer:
        cfg = self.config
        self._params = [torch.zeros_like(seg.anchor) for seg in self._flat.segments]  # type: ignore[arg-type]
        if cfg.outer_optimizer == "diloco":
            lr = DILOCO_LR if cfg.outer_lr is None else float(cfg.outer_lr)
            momentum = DILOCO_MOMENTUM if cfg.outer_momentum is None else float(cfg.outer_momentum)
            return torch.optim.SGD(self._params, lr=lr, momentum=momentum, nesterov=True)
        cls = getattr(torch.optim, cfg.outer_optimizer)
        options: dict[str, Any] = {"lr": 1.0 if cfg.outer_lr is None else float(cfg.outer_lr)}
        if cfg.outer_momentum is not None:
            options["momentum"] = float(cfg.outer_momentum)
        try:
            return cls(self._params, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"outer_optimizer {cfg.outer_optimizer!r} refused {options}: {exc}; pass outer_lr/outer_momentum "
                "it accepts (outer_momentum only for optimizers with a momentum argument)"
            ) from None

    @torch.no_grad()
    def update(self, param_groups: Sequence[dict], averages: list[torch.Tensor]) -> None:
        """x0 ← outer step on ``x0 − x̄``; ``averages`` (x̄, per segment) are overwritten with the new x0."""
        if self.is_slowmo:
            self._flat.slowmo_update(param_groups, beta=float(self.config.slowmo_momentum),
                                     alpha=float(self.config.slowmo_lr), averages=averages)
            return
        if self._optim is None:
            self._optim = self._build()
        for seg, param, xbar in zip(self._flat.segments, self._params, averages, strict=True):
            x0 = seg.anchor
            assert x0 is not None
            target = xbar[: seg.numel]
            param.copy_(x0)
            param.grad = torch.sub(x0, target.to(x0.dtype))
        self._optim.step()
        for seg, param, xbar in zip(self._flat.segments, self._params, averages, strict=True):
            seg.anchor.copy_(param)  # type: ignore[union-attr]
            xbar[: seg.numel].copy_(param)
            param.grad = None

    def state_dict(self) -> dict[str, Any] | None:
        if self._optim is None:
            return None
        sd = self._optim.state_dict()
        return {"state": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in sd["state"].get(i, {}).items()}
                          for i in range(len(self._params))],
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None or self.is_slowmo:
            self._optim = None
            return
        self._optim = self._build()
        n = len(self._params)
        if len(state["state"]) != n:
            raise ConfigError(
                f"checkpoint has outer-optimizer state for {len(state['state'])} segments, this model has {n}: "
                "load a checkpoint saved with the same model and optimizer"
            )
        groups = [{**g, "params": list(range(n))} for g in state["param_groups"]]
        self._optim.load_state_dict({"state": {i: dict(s) for i, s in enumerate(state["state"]) if s},
                                     "param_groups": groups})
