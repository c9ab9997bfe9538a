"""The model's configuration: its shape and the switches that make one decoder every family (see
jaxserve/model/transformer.py), loaded from a checkpoint's config (jaxserve/checkpoint)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.errors import JaxserveError

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe")
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("linear", "llama3", "longrope")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Rotary-frequency scaling: `linear` divides every frequency, `llama3` only the low ones, `longrope` (Phi-3)
    divides each frequency by its own factor, `short_factor` at positions below original_max_position_embeddings
    and `long_factor` from there on, and multiplies cos and sin by `attention_factor`."""

    kind: Literal["linear", "llama3", "longrope"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise JaxserveError(f"unsupported rope scaling type {self.kind!r}; expected one of {ROPE_SCALINGS}")
        if self.factor <= 0:
            raise JaxserveError(f"rope scaling factor must be positive, got {self.factor}")
        for name in ("short_factor", "long_factor"):  # a JSON list, hashable once a tuple (the config is a jit key)
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.kind == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise JaxserveError(f"longrope scaling needs short_factor and long_factor of one length (head_dim / 2), "
                                f"got {len(self.short_factor)} and {len(self.long_factor)}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of the decoder. One model for every family: the families differ by the switches below,
    each off (Llama's behaviour) by default; `jaxserve info --json` lists those a model turns on (`switches`)."""

    architecture: str = "llama"  # the family it was loaded as (ARCHITECTURES); the model reads only the switches
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v biases (Qwen2)
    # -- switches --
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    # Local attention: a query sees the last `sliding_window` positions, its own included (Mistral, Qwen2, Phi-3,
    # Gemma). `local_layers` names the layers that do; None means every layer when sliding_window is set.
    sliding_window: int | None = None
    local_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None  # the RoPE base of local layers, which also take no rope_scaling (Gemma 3)
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU: Gemma)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    sandwich_norm: bool = False  # an RMSNorm on the attention's and the MLP's outputs before each residual add (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power, not head_dim's (Gemma)
    attn_softcap: float | None = None  # attention scores become cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # and the logits likewise (Gemma 2)
    # Mixture of experts in every layer's MLP when num_experts > 0 (Mixtral, Qwen3-MoE): each token's
    # experts_per_token most probable experts (softmax over all experts' router logits), weighted by their
    # probabilities, renormalised to sum to 1 with norm_topk_prob (Mixtral always; Qwen3-MoE by its config).
    # Each expert is a gated MLP of moe_intermediate_size; intermediate_size is then unused.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise JaxserveError(
                f"unknown architecture {self.architecture!r}; jaxserve supports {', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise JaxserveError(f"model config {name} must be at least 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise JaxserveError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise JaxserveError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.activation not in ACTIVATIONS:
            raise JaxserveError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise JaxserveError(f"sliding_window must be at least 1 (or null: global attention), got {self.sliding_window}")
        if self.local_layers is not None:
            object.__setattr__(self, "local_layers", tuple(int(i) for i in self.local_layers))
            bad = [i for i in self.local_layers if not 0 <= i < self.num_layers]
            if bad or self.sliding_window is None:
                raise JaxserveError(f"local_layers={self.local_layers} must be layer indices below num_layers="
                                    f"{self.num_layers}, with a sliding_window (got {self.sliding_window})")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise JaxserveError(f"{name} must be positive (or null: off), got {getattr(self, name)}")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.moe_intermediate_size > 0):
            raise JaxserveError(f"a mixture of {self.num_experts} experts needs experts_per_token in [1, "
                                f"{self.num_experts}] (got {self.experts_per_token}) and moe_intermediate_size >= 1 "
                                f"(got {self.moe_intermediate_size})")
        if self.num_experts < 0:
            raise JaxserveError(f"num_experts must be >= 0 (0: a dense MLP), got {self.num_experts}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.kind == "longrope" and len(scaling.short_factor) != self.head_dim // 2:
            raise JaxserveError(f"longrope factors have {len(scaling.short_factor)} entries; head_dim={self.head_dim} "
                                f"needs {self.head_dim // 2}")

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return self.sliding_window is not None and (self.local_layers is None or layer in self.local_layers)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`; None when it attends to every earlier position."""
        return self.sliding_window if self.is_local(layer) else None

    @property
    def attention_span(self) -> int | None:
        """How far back any layer reads: the widest window when every layer has one (the positions behind it are
        never read again, so their pages can go back to the pool), None when a layer attends to everything."""
        windows = [self.window(layer) for layer in range(self.num_layers)]
        return None if None in windows else max(windows)  # type: ignore[type-var]

    @property
    def switches(self) -> dict[str, Any]:
        """The switches this model turns on (those that differ from Llama's), by name; rope_scaling by its kind."""
        fields = dataclasses.fields(self)
        on = {f.name: getattr(self, f.name) for f in fields[fields.index(next(f for f in fields if f.name == "qk_norm")):]
              if getattr(self, f.name) != f.default and (self.num_experts or f.name != "norm_topk_prob")}
        extra = {"attention_bias": self.attention_bias, "rope_scaling": self.rope_scaling and self.rope_scaling.kind}
        return {**{k: v for k, v in extra.items() if v}, **on}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)
