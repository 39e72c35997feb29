"""Checkpointing of the slice executors through ``torch.distributed.checkpoint`` (DCP).

A mixin of :class:`~cpdpkit.shard._slices.SliceExecutor`: ``state_dict`` / ``load_state_dict``
of the model (``get_model_state_dict``: FSDP2's DTensor shards for
:class:`~cpdpkit.shard.executor.TwoStageExecutor`, the replicated parameters for
:class:`~cpdpkit.shard.partial.PartialShardExecutor`) and of this rank's optimizer slices,
saved under a key holding its replicate and shard coordinates so that every rank saves distinct
entries (DCP de-duplicates plain tensors saved under one key by several ranks). Loading needs the
same plan and mesh: no resharding to another mesh or world size. Torch is imported inside the
functions (the layering check keeps ``cpdpkit.planner`` torch-free but for the executors).
"""

from __future__ import annotations

import json
from typing import Any

from cpdpkit.planner.config import PlannerError

__all__ = ["ExecutorStateMixin"]


class ExecutorStateMixin:
    """``state_dict``/``load_state_dict``/``sync_from_model``; needs the executor's units, optimizer and mesh."""

    def _model_values(self, unit: Any) -> Any:
        """The current model values of ``unit``'s replicate-axis vector (its ``numel`` real elements)."""
        raise NotImplementedError

    def _layout(self) -> list[dict[str, Any]]:
        return [{"unit": u.name, "numel": u.numel, "lo": u.lo, "hi": u.hi} for u in self._units]

    def _coords_key(self) -> str:
        return (f"rep{self._rep_rank}of{self._rep_size}_"
                f"shard{self.mesh.get_local_rank('shard')}of{self.mesh.size(1)}")

    def _materialized_state(self) -> tuple[dict[int, dict[str, Any]], set[int]]:
        """The inner optimizer's per-slice state with every slice present (for DCP's load template).

        Slices that have not been stepped yet get their state created by a zero-lr step on zero
        gradients (what ``torch.distributed.checkpoint.state_dict`` does for optimizers); that
        state is returned but removed from the optimizer again, so training is unaffected.
        Returns ``(state by slice index, indices of slices that really have state)``.
        """
        import torch

        opt = self.optimizer
        stepped = {i for i, u in enumerate(self._units) if opt.state.get(u.slice_param)}
        missing = [u for i, u in enumerate(self._units) if i not in stepped]
        if missing:
            saved_lrs, saved_vals = [], [u.slice_param.detach().clone() for u in missing]
            for group in opt.param_groups:
                saved_lrs.append(group.get("lr"))
                if "lr" in group:
                    group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            try:
                for u in missing:
                    u.slice_param.grad = torch.zeros_like(u.slice_param)
                    opt.step()
                    u.slice_param.grad = None
            finally:
                for group, lr in zip(opt.param_groups, saved_lrs):
                    if "lr" in group:
                        group["lr"] = lr
                with torch.no_grad():
                    for u, v in zip(missing, saved_vals):
                        u.slice_param.copy_(v)
        state = {i: dict(opt.state[u.slice_param]) for i, u in enumerate(self._units)}
        for u in missing:  # keep the optimizer exactly as it was
            opt.state.pop(u.slice_param, None)
        return state, stepped

    def state_dict(self, *, include_model: bool = True) -> dict[str, Any]:
        """A ``torch.distributed.checkpoint`` (DCP) state dict of the model and this rank's optimizer slices.

        ``{"model": ..., "optim": {"rep<r>of<R>_shard<s>of<S>": {"layout": ..., "units": {...}}}}``:

        * ``"model"`` (unless ``include_model=False``): from
          :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict` (FSDP2's sharded
          DTensors, or the replicated parameters; DCP deduplicates identical copies).
        * ``"optim"``: one entry per rank, keyed by its replicate and shard coordinates: per unit
          the inner optimizer's state tensors of this rank's flat slice (``"state"``) and the
          unit's param-group hyperparameters (``"group"``), plus the slice ``"layout"`` (a JSON
          string) that :meth:`load_state_dict` checks. Slices not stepped yet are given state
          (so a fresh executor's dict can be DCP's load template) and marked as not stepped.

        Use ``dcp.save(ex.state_dict(), ...)``; ``sd = ex.state_dict(); dcp.load(sd, ...);
        ex.load_state_dict(sd)`` to resume (or pass the executor itself, a DCP ``Stateful``).
        Call it between steps; pending exchanges are finished first.
        """
        self.wait_exchanges()
        state, stepped = self._materialized_state()
        groups = self.optimizer.state_dict()["param_groups"]
        units = {u.name: {"state": state[i], "group": {k: v for k, v in groups[i].items() if k != "params"}}
                 for i, u in enumerate(self._units)}
        layout = [{**entry, "stepped": i in stepped} for i, entry in enumerate(self._layout())]
        meta = json.dumps({"replicate_size": self._rep_size, "shard_size": self.mesh.size(1),
                           "replicate_rank": self._rep_rank, "shard_rank": self.mesh.get_local_rank("shard"),
                           "units": layout})
        out: dict[str, Any] = {"optim": {self._coords_key(): {"layout": meta, "units": units}}}
        if include_model:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            out["model"] = get_model_state_dict(self.model)
        return out

    def _saved_layout(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's optimizer entry of ``state`` and its parsed layout, checked against this executor."""
        key, who = self._coords_key(), type(self).__name__
        entry = state.get("optim", {}).get(key)
        if entry is None:
            raise PlannerError(f"the checkpoint has no optimizer state for this rank's mesh coordinates ({key}); "
                               f"it holds {sorted(state.get('optim', {}))}. {who} cannot reshard: load it "
                               "with the same plan on the same (replicate, shard) mesh")
        try:
            saved = json.loads(entry["layout"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlannerError(f"optimizer entry {key} has no readable slice layout") from exc
        mine = self._layout()
        theirs = [{k: v for k, v in u.items() if k != "stepped"} for u in saved.get("units", [])]
        if theirs != mine or saved.get("replicate_size") != self._rep_size \
                or saved.get("shard_size") != self.mesh.size(1):
            raise PlannerError(f"optimizer state {key} was saved for another plan/mesh: slice layout {theirs} "
                               f"(mesh {saved.get('replicate_size')}x{saved.get('shard_size')}), this executor has "
                               f"{mine} (mesh {self._rep_size}x{self.mesh.size(1)}); {who} cannot "
                               "reshard optimizer state")
        return entry, saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (e.g. after ``dcp.load`` into it) saved with the same plan and mesh.

        Restores the model (``"model"``, if present, through
        :func:`~torch.distributed.checkpoint.state_dict.set_model_state_dict`), this rank's
        optimizer state and hyperparameters, and the slices from the model. Resharding to another
        mesh or plan is not supported: ``dcp.load`` itself fails with a missing
        ``optim.rep<r>of<R>_shard<s>of<S>...`` key when the mesh differs, and this method raises
        :class:`PlannerError` when the entry for this rank's coordinates is missing or its slice
        layout differs.
        """
        self.wait_exchanges()
        entry, saved = self._saved_layout(state)
        if "model" in state:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict
            set_model_state_dict(self.model, state["model"])
        units = entry["units"]
        opt_state = {i: dict(units[u.name]["state"]) for i, (u, s) in enumerate(zip(self._units, saved["units"]))
                     if s["stepped"]}
        groups = [{**units[u.name]["group"], "params": [i]} for i, u in enumerate(self._units)]
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        for i, u in enumerate(self._units):  # load_state_dict keeps nothing for slices never stepped
            if i not in opt_state:
                self.optimizer.state.pop(u.slice_param, None)
        self.sync_from_model()

    def sync_from_model(self) -> None:
        """Copy the model's current parameter values into the slices (after loading model weights)."""
        import torch

        self.wait_exchanges()
        with torch.no_grad():
            for u in self._units:
                u.slice_param.copy_(self._model_values(u)[u.lo:u.hi])
