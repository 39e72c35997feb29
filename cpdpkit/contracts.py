"""The contract between :class:`~cpdpkit.sync.PeriodicSyncOptimizer` and the slice executors, both ways.

A :class:`~cpdpkit.shard.TwoStageExecutor` or :class:`~cpdpkit.shard.PartialShardExecutor` built on
one site's mesh can be synchronised across sites by a ``PeriodicSyncOptimizer``
(``PeriodicSyncOptimizer(ex.optimizer, model=ex, group=<across sites>, ...)``). Neither package
imports the other (``sync`` sits below ``shard`` in the layering), so what each side calls on the
other is written here, once, as two ``runtime_checkable`` protocols, and both sides dispatch on them:

* :class:`SyncedExecutor`: what the optimizer needs of a model that is an executor. The optimizer
  recognises one with ``isinstance(model, SyncedExecutor)``; the checkpoint asks it for its state
  without the model (``state_dict(include_model=False)``: the model is saved on its own).
* :class:`OuterSync`: what the executor calls back. ``attach_periodic_sync(outer)`` refuses an
  ``outer`` that is not one, and the executor calls nothing else on it.

One step over an attached executor (the order both sides rely on)::

    opt.zero_grad()                -> ex.zero_grad()
    loss.backward()                   the executor's gradient hooks: when outer.gradient_sync_due(),
                                      each slice gradient, reduced inside the mesh, goes to
                                      outer.reduce_gradient(slice_param, grad), in hook order
    opt.step()                     -> ex.step(): the executor updates its slices; if
                                      outer.defers_exchange() was true, it calls outer.after_updates()
                                      (the reconciliation of the slices across sites) before it
                                      exchanges the updated slices inside the mesh

``publish_slices()`` writes the slices into the model (after the optimizer's initial broadcast and
after an average is applied); ``set_requires_gradient_sync(False)`` is the optimizer's ``no_sync``.

Imports nothing at run time (no torch): the annotations name torch's types for readers and checkers only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["OuterSync", "SyncedExecutor"]


@runtime_checkable
class OuterSync(Protocol):
    """What an executor calls on the optimizer that synchronises it across replicas (its ``outer``)."""

    def gradient_sync_due(self) -> bool:
        """Whether the coming backward's gradients are averaged across replicas (asked before backward)."""
        ...

    def reduce_gradient(self, slice_param: torch.Tensor, grad: torch.Tensor) -> None:
        """One slice gradient, reduced inside the mesh: averaged across replicas in place (``grad``) before
        :meth:`SyncedExecutor.step` updates ``slice_param``."""
        ...

    def defers_exchange(self) -> bool:
        """Whether the coming step changes the slices after their update (a gradient sync, a reconciliation,
        an average applied): then the executor updates every slice in ``step()``, calls :meth:`after_updates`,
        and only then exchanges the slices."""
        ...

    def after_updates(self) -> None:
        """The slices are updated and not yet exchanged: run this step's periodic work (a reconciliation)."""
        ...


@runtime_checkable
class SyncedExecutor(Protocol):
    """What :class:`~cpdpkit.sync.PeriodicSyncOptimizer` (and the checkpoint) needs of an executor model."""

    model: nn.Module  # the module the executor trains (the optimizer syncs its buffers and names its parameters)
    optimizer: torch.optim.Optimizer  # the executor's own, over its slices: the one the wrapper must wrap
    mesh: DeviceMesh  # one replica's ranks; the wrapper's group crosses replicas
    plan: Any  # the cpdpkit.planner.ShardingPlan it runs (its strategy names a checkpoint)

    def attach_periodic_sync(self, outer: OuterSync) -> list[torch.Tensor]:
        """Make ``outer`` this executor's synchroniser across replicas (once); returns the slice parameters."""
        ...

    def publish_slices(self) -> None:
        """Write the slices into the model's parameters."""
        ...

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: the coming backwards accumulate gradients without reducing them (``no_sync``)."""
        ...

    def zero_grad(self) -> None: ...

    def step(self) -> float | None:
        """Update the slices with the reduced gradients and exchange them (the module docstring's order);
        the gradient norm when the executor clips, else None."""
        ...

    def state_dict(self, *, include_model: bool = True) -> dict[str, Any]:
        """Torch's optimizer layout of the slices' state; ``include_model=False`` leaves the model out."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
