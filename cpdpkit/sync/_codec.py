"""Codecs for a compressed reconciliation, and the error-feedback exchange that uses them.

``compression`` (:class:`~cpdpkit.sync.SyncConfig`) names how each rank's payload, the
pseudo-gradient ``d = x0 − x`` (the anchor minus this rank's parameters) plus its residual, crosses
the slow group:

* ``"none"``: no codec (the parameters are averaged in fp32 as always);
* ``"bf16"``: ``d`` rounded to bfloat16 (2 bytes per element);
* ``"int8"``: blocks of :data:`INT8_BLOCK` elements, each with an fp32 scale ``max|d|/127`` and int8
  codes ``round(d/scale)`` (1 byte per element plus 4 per block; any tensor shape: the flat
  segment is padded to whole blocks);
* ``"topk:F"``: the ``k = ceil(F·n)`` largest-magnitude elements: one fp32 scale, then int32 indices
  and int8 values (5 bytes per kept element plus 4).

Error feedback: every rank keeps ``r`` (the shape of its payload: shard-sized over FSDP2 and the
executors); at a reconciliation it encodes ``p = d + r`` and keeps ``r ← p − decode(encode(p))``,
so over any number of reconciliations the sum of what it sent plus its residual equals the sum of
its payloads. The codes of every rank are exchanged in one all-gather of bytes per segment (a real
collective: the emulator counts it as ``all_gather`` and the network model prices it), and every
rank decodes all of them in rank order, so the mean ``m = mean_j decode(code_j)`` is the same
bit for bit on every rank; the reconciled average is then ``x0 − m``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cpdpkit.errors import ConfigError

__all__ = ["Codec", "parse_compression", "CODEC_NAMES", "INT8_BLOCK", "ErrorFeedback"]

CODEC_NAMES = ("none", "bf16", "int8", "topk:F")
INT8_BLOCK = 256  # elements per int8 scale


def parse_compression(value: object) -> tuple[str, float | None]:
    """``(name, fraction)`` of a ``compression`` value, or a one-line ConfigError."""
    if not isinstance(value, str):
        raise ConfigError(f"compression must be a string, got {value!r}: pass 'none', 'bf16', 'int8' or 'topk:0.02'")
    if value in ("none", "bf16", "int8"):
        return value, None
    if value.startswith("topk:"):
        text = value[len("topk:"):]
        try:
            frac = float(text)
        except ValueError:
            frac = math.nan
        if not (0.0 < frac <= 1.0):
            raise ConfigError(f"compression {value!r}: the top-k fraction {text!r} must be in (0, 1]; "
                              "pass e.g. 'topk:0.02' for the largest 2 % of each payload")
        return "topk", frac
    raise ConfigError(f"compression {value!r} is not a codec: pass one of 'none', 'bf16', 'int8' or "
                      "'topk:F' with F in (0, 1], e.g. 'topk:0.02'")


class Codec:
    """Encodes a flat fp32 vector of ``numel`` elements into a fixed number of bytes, and back."""

    def __init__(self, compression: str, numel: int) -> None:
        self.name, self.frac = parse_compression(compression)
        self.numel = numel
        if self.name == "int8":
            self.blocks = max(1, math.ceil(numel / INT8_BLOCK))
        elif self.name == "topk":
            self.k = min(numel, max(1, math.ceil(self.frac * numel)))  # type: ignore[operator]

    @property
    def nbytes(self) -> int:
        """Bytes one rank's code of this segment takes."""
        if self.name == "bf16":
            return 2 * self.numel
        if self.name == "int8":
            return self.blocks * INT8_BLOCK + 4 * self.blocks
        if self.name == "topk":
            return 4 * self.k + self.k + 4
        return 4 * self.numel

    def encode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(code as uint8 bytes, decode(code))`` of a flat fp32 ``payload``."""
        x = payload.float()
        if self.name == "bf16":
            low = x.to(torch.bfloat16)
            return low.view(torch.uint8), low.float()
        if self.name == "int8":
            padded = torch.zeros(self.blocks * INT8_BLOCK, dtype=torch.float32)
            padded[: self.numel] = x
            blocks = padded.view(self.blocks, INT8_BLOCK)
            scale = blocks.abs().amax(dim=1) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
            code = torch.cat([codes.view(-1).view(torch.uint8), scale.view(torch.uint8)])
            return code, self.decode(code)
        if self.name == "topk":
            idx = torch.topk(x.abs(), self.k, sorted=False).indices.to(torch.int32)
            idx, _ = torch.sort(idx)
            kept = x[idx.long()]
            scale = kept.abs().amax().reshape(1) / 127.0
            safe = scale if float(scale) > 0 else torch.ones_like(scale)
            values = torch.round(kept / safe).clamp_(-127, 127).to(torch.int8)
            code = torch.cat([scale.view(torch.uint8), idx.view(torch.uint8), values.view(torch.uint8)])
            return code, self.decode(code)
        raise AssertionError(self.name)

    def decode(self, code: torch.Tensor) -> torch.Tensor:
        """The flat fp32 vector of ``numel`` elements a code stands for."""
        if code.storage_offset() % 4:  # a slice of a gathered buffer: realign for the fp32/int32 views
            code = code.clone()
        if self.name == "bf16":
            return code.view(torch.bfloat16).float()
        if self.name == "int8":
            n = self.blocks * INT8_BLOCK
            codes = code[:n].view(torch.int8).float().view(self.blocks, INT8_BLOCK)
            scale = code[n:].view(torch.float32)
            return (codes * scale[:, None]).view(-1)[: self.numel]
        if self.name == "topk":
            k = self.k
            scale = code[:4].view(torch.float32)
            idx = code[4 : 4 + 4 * k].view(torch.int32).long()
            values = code[4 + 4 * k :].view(torch.int8).float()
            out = torch.zeros(self.numel, dtype=torch.float32)
            out[idx] = values * scale
            return out
        raise AssertionError(self.name)


class ErrorFeedback:
    """Per-segment residuals and codecs of one rank (module docstring)."""

    def __init__(self, compression: str, sizes: Sequence[int]) -> None:
        self.codecs = [Codec(compression, n) for n in sizes]
        self.residuals = [torch.zeros(n, dtype=torch.float32) for n in sizes]

    def encode(self, payloads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The codes of ``payloads + residuals``; the residuals keep what the codes lost."""
        assert len(payloads) == len(self.codecs), (len(payloads), len(self.codecs))
        return [self.encode_one(i, payload) for i, payload in enumerate(payloads)]

    def encode_one(self, i: int, payload: torch.Tensor) -> torch.Tensor:
        """The code of segment ``i``'s ``payload + residual``; the residual keeps what the code lost."""
        residual = self.residuals[i]
        p = payload.reshape(-1).float() + residual
        code, sent = self.codecs[i].encode(p)
        residual.copy_(p - sent)
        return code

    def mean_of(self, gathered: Sequence[torch.Tensor], size: int) -> list[torch.Tensor]:
        """The mean of every rank's decoded code (``gathered``: per segment, ``size`` codes in rank order)."""
        assert len(gathered) == len(self.codecs), (len(gathered), len(self.codecs))
        return [self.mean_one(i, codes, size) for i, codes in enumerate(gathered)]

    def mean_one(self, i: int, codes: torch.Tensor, size: int) -> torch.Tensor:
        """The mean of segment ``i``'s ``size`` codes (every rank's, in rank order), decoded in rank order."""
        codec = self.codecs[i]
        total = torch.zeros(codec.numel, dtype=torch.float32)
        for j in range(size):
            total += codec.decode(codes[j * codec.nbytes : (j + 1) * codec.nbytes])
        return total / size

    def state(self) -> list[torch.Tensor]:
        return [r.clone() for r in self.residuals]

    def load(self, residuals: Sequence[torch.Tensor] | None) -> None:
        if residuals is None:
            for r in self.residuals:
                r.zero_()
            return
        if [r.numel() for r in residuals] != [r.numel() for r in self.residuals]:
            raise ConfigError("checkpoint's compression residuals do not fit this model's shards: load a "
                              "checkpoint saved with the same model, sharding and compression")
        for mine, saved in zip(self.residuals, residuals, strict=True):
            mine.copy_(saved)
