"""Parameter shapes of public architectures, for planning without building the model.

Shapes follow the public configs and reference implementations (no weights):

* ``resnet50``: torchvision ResNet-50 (Bottleneck [3, 4, 6, 3], 1000 classes), 25,557,032 params.
* ``vit-s``: ViT-S/16 at 224 px (timm ``vit_small_patch16_224``: dim 384, depth 12, 6 heads,
  MLP 1536, 1000 classes), 22,050,664 params.
* ``llama-7b``: LLaMA-2 7B (32 layers, hidden 4096, intermediate 11008, 32 heads, vocab 32000),
  6,738,415,616 params.
* ``llama-70b``: LLaMA-2 70B (80 layers, hidden 8192, intermediate 28672, 64 heads / 8 KV heads,
  vocab 32000), 68,976,648,192 params.

Parameter names follow the reference code (torchvision, timm, Meta's llama ``model.py``).

:func:`load_model_spec` resolves any model input (a spec, an ``nn.Module``, a preset name or
``"package.module:factory"``) here, where both the presets and :mod:`~cpdpkit.planner.model_spec`
are visible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cpdpkit.planner.config import PlannerError
from cpdpkit.planner.model_spec import ROOT, BlockSpec, ModelSpec, ParamSpec

__all__ = ["MODEL_PRESETS", "model_preset", "llama_spec", "load_model_spec"]


class _Builder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.params: list[ParamSpec] = []
        self.blocks: list[BlockSpec] = []

    def block(self, fqn: str, container: str) -> int:
        self.blocks.append(BlockSpec(fqn=fqn, container=container))
        return len(self.blocks) - 1

    def add(self, fqn: str, *shape: int, block: int = ROOT) -> None:
        self.params.append(ParamSpec(fqn=fqn, shape=shape, block=block))

    def linear(self, fqn: str, out_f: int, in_f: int, *, bias: bool = True, block: int = ROOT) -> None:
        self.add(f"{fqn}.weight", out_f, in_f, block=block)
        if bias:
            self.add(f"{fqn}.bias", out_f, block=block)

    def norm(self, fqn: str, dim: int, *, bias: bool = True, block: int = ROOT) -> None:
        self.add(f"{fqn}.weight", dim, block=block)
        if bias:
            self.add(f"{fqn}.bias", dim, block=block)

    def spec(self) -> ModelSpec:
        return ModelSpec(name=self.name, params=tuple(self.params), blocks=tuple(self.blocks))


def llama_spec(name: str, *, num_layers: int, hidden: int, intermediate: int, num_heads: int,
               num_kv_heads: int, vocab: int) -> ModelSpec:
    """A LLaMA-style decoder: embeddings and the output head in the root, one block per layer."""
    b = _Builder(name)
    kv_dim = hidden // num_heads * num_kv_heads
    b.add("tok_embeddings.weight", vocab, hidden)
    for i in range(num_layers):
        k = b.block(f"layers.{i}", "layers")
        p = f"layers.{i}"
        b.linear(f"{p}.attention.wq", hidden, hidden, bias=False, block=k)
        b.linear(f"{p}.attention.wk", kv_dim, hidden, bias=False, block=k)
        b.linear(f"{p}.attention.wv", kv_dim, hidden, bias=False, block=k)
        b.linear(f"{p}.attention.wo", hidden, hidden, bias=False, block=k)
        b.linear(f"{p}.feed_forward.w1", intermediate, hidden, bias=False, block=k)
        b.linear(f"{p}.feed_forward.w2", hidden, intermediate, bias=False, block=k)
        b.linear(f"{p}.feed_forward.w3", intermediate, hidden, bias=False, block=k)
        b.norm(f"{p}.attention_norm", hidden, bias=False, block=k)
        b.norm(f"{p}.ffn_norm", hidden, bias=False, block=k)
    b.norm("norm", hidden, bias=False)
    b.linear("output", vocab, hidden, bias=False)
    return b.spec()


def _vit_s() -> ModelSpec:
    b = _Builder("vit-s")
    dim, mlp, depth, patch, tokens = 384, 1536, 12, 16, 197
    b.add("cls_token", 1, 1, dim)
    b.add("pos_embed", 1, tokens, dim)
    b.add("patch_embed.proj.weight", dim, 3, patch, patch)
    b.add("patch_embed.proj.bias", dim)
    for i in range(depth):
        k = b.block(f"blocks.{i}", "blocks")
        p = f"blocks.{i}"
        b.norm(f"{p}.norm1", dim, block=k)
        b.linear(f"{p}.attn.qkv", 3 * dim, dim, block=k)
        b.linear(f"{p}.attn.proj", dim, dim, block=k)
        b.norm(f"{p}.norm2", dim, block=k)
        b.linear(f"{p}.mlp.fc1", mlp, dim, block=k)
        b.linear(f"{p}.mlp.fc2", dim, mlp, block=k)
    b.norm("norm", dim)
    b.linear("head", 1000, dim)
    return b.spec()


def _resnet50() -> ModelSpec:
    b = _Builder("resnet50")
    b.add("conv1.weight", 64, 3, 7, 7)
    b.norm("bn1", 64)
    in_ch = 64
    for stage, (width, num_blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for j in range(num_blocks):
            p = f"layer{stage}.{j}"
            k = b.block(p, f"layer{stage}")
            out_ch = width * 4
            b.add(f"{p}.conv1.weight", width, in_ch, 1, 1, block=k)
            b.norm(f"{p}.bn1", width, block=k)
            b.add(f"{p}.conv2.weight", width, width, 3, 3, block=k)
            b.norm(f"{p}.bn2", width, block=k)
            b.add(f"{p}.conv3.weight", out_ch, width, 1, 1, block=k)
            b.norm(f"{p}.bn3", out_ch, block=k)
            if j == 0:
                b.add(f"{p}.downsample.0.weight", out_ch, in_ch, 1, 1, block=k)
                b.norm(f"{p}.downsample.1", out_ch, block=k)
            in_ch = out_ch
    b.linear("fc", 1000, 2048)
    return b.spec()


MODEL_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "resnet50": _resnet50,
    "vit-s": _vit_s,
    "llama-7b": lambda: llama_spec("llama-7b", num_layers=32, hidden=4096, intermediate=11008,
                                   num_heads=32, num_kv_heads=32, vocab=32000),
    "llama-70b": lambda: llama_spec("llama-70b", num_layers=80, hidden=8192, intermediate=28672,
                                    num_heads=64, num_kv_heads=8, vocab=32000),
}


def model_preset(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of preset ``name`` (see :data:`MODEL_PRESETS`)."""
    if name not in MODEL_PRESETS:
        raise PlannerError(f"unknown model preset {name!r}; use one of {', '.join(MODEL_PRESETS)} "
                           "or 'package.module:factory'")
    return MODEL_PRESETS[name]()


def load_model_spec(spec: Any) -> ModelSpec:
    """A :class:`ModelSpec` from a spec, an ``nn.Module``, a preset name or ``"pkg.mod:factory"``.

    The factory is called with no arguments under ``torch.device("meta")``, so it allocates nothing.
    """
    if isinstance(spec, ModelSpec):
        return spec
    if not isinstance(spec, str):
        return ModelSpec.from_module(spec)
    if ":" not in spec:
        return model_preset(spec)  # names the presets when there is none of that name
    return ModelSpec.from_factory(spec)
