"""The reduce-scatter of codes: a compressed mean whose decode work and received bytes stop growing with the replicas.

The all-gather of codes (:class:`~cpdpkit.sync._codec.ErrorFeedback`) has every one of W ranks receive W − 1
codes of the whole tensor and decode W of them. torchft's quantised all-reduce instead cuts the tensor (n
elements, zero-padded to W·c, ``c = ceil(n / W)``) into W chunks and runs two exchanges:

1. each rank encodes its chunks of (payload + its residual ``r``) and keeps ``r ← p − decode`` (n elements);
   an **all-to-all** sends chunk j's code to rank j, so rank j receives chunk j of every rank (in rank order);
2. rank j decodes those W codes, averages them in rank order, adds its *chunk residual* ``s`` (c elements) and
   re-encodes the chunk mean, keeping ``s ← m − decode``; an **all-gather** of the chunk-mean codes gives every
   rank all W chunks, decoded into the same n-element mean, bit for bit on every rank.

Per rank that is 2·W chunk decodes (about 2 × one tensor) instead of W whole ones, and ``(W − 1)/W`` of W
chunk codes through each exchange (about 2 (W − 1)/W × one code) instead of (W − 1) codes: the same at W = 2,
less from W = 3. The emulator counts both collectives at the network model's price (``all_to_all`` of
``W·B`` bytes, ``all_gather`` of ``W·B``, B one chunk's code).
"""

from __future__ import annotations

import math

import torch

from cpdpkit.errors import ConfigError
from cpdpkit.sync._codec import Codec

__all__ = ["ChunkedFeedback", "CHUNKED_FROM"]

CHUNKED_FROM = 3  # replicas from which the reduce-scatter of codes replaces the all-gather (equal bytes at 2)


class ChunkedFeedback:
    """One tensor's two-stage compressed mean over ``replicas`` ranks, with both residuals (module docstring)."""

    def __init__(self, compression: str, numel: int, replicas: int) -> None:
        self.numel, self.replicas = numel, replicas
        self.chunk = max(1, math.ceil(numel / replicas))
        self.codec = Codec(compression, self.chunk)
        self.residual = torch.zeros(numel, dtype=torch.float32)  # what this rank's chunk codes lost
        self.chunk_residual = torch.zeros(self.chunk, dtype=torch.float32)  # what its chunk mean's code lost

    @staticmethod
    def state_numel(numel: int, replicas: int) -> int:
        """Elements of :meth:`state` for a tensor of ``numel`` elements: both residuals."""
        return numel + max(1, math.ceil(numel / replicas))

    @classmethod
    def numel_of_state(cls, state_numel: int, replicas: int) -> int | None:
        """The tensor's ``numel`` whose :meth:`state` has ``state_numel`` elements (None: none has)."""
        guess = state_numel * replicas // (replicas + 1)
        for numel in range(max(0, guess - 2), guess + 3):
            if cls.state_numel(numel, replicas) == state_numel:
                return numel
        return None

    def _codes(self, codes: torch.Tensor) -> list[torch.Tensor]:
        size = self.codec.nbytes
        return [codes[j * size : (j + 1) * size] for j in range(self.replicas)]

    def encode(self, payload: torch.Tensor) -> torch.Tensor:
        """Stage 1's send buffer: the codes of the W chunks of (``payload`` + residual), chunk j (for rank j) j-th."""
        padded = torch.zeros(self.replicas * self.chunk, dtype=torch.float32)
        padded[: self.numel] = payload.reshape(-1).float() + self.residual
        codes, sent = [], []
        for piece in padded.split(self.chunk):
            code, decoded = self.codec.encode(piece)
            codes.append(code)
            sent.append(decoded)
        self.residual.copy_((padded - torch.cat(sent))[: self.numel])
        return torch.cat(codes)

    def reencode(self, received: torch.Tensor) -> torch.Tensor:
        """Stage 2's code: this rank's chunk of every rank (``received``, rank order), averaged and re-encoded."""
        total = torch.zeros(self.chunk, dtype=torch.float32)
        for code in self._codes(received):
            total += self.codec.decode(code)
        mean = total / self.replicas + self.chunk_residual
        code, decoded = self.codec.encode(mean)
        self.chunk_residual.copy_(mean - decoded)
        return code

    def mean(self, gathered: torch.Tensor) -> torch.Tensor:
        """The mean: every rank's chunk-mean code (``gathered``, rank order) decoded, ``numel`` elements."""
        return torch.cat([self.codec.decode(code) for code in self._codes(gathered)])[: self.numel]

    def state(self) -> torch.Tensor:
        return torch.cat([self.residual, self.chunk_residual])

    def load(self, saved: torch.Tensor) -> None:
        if saved.numel() != self.numel + self.chunk:
            raise ConfigError("checkpoint's compression residuals do not fit this model's shards: load a "
                              "checkpoint saved with the same model, sharding, number of replicas and compression")
        flat = saved.reshape(-1).float()
        self.residual.copy_(flat[: self.numel])
        self.chunk_residual.copy_(flat[self.numel :])
