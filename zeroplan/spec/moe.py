"""MoeSpec: the mixture-of-experts part of a model — routed and shared experts, the router, and
how the experts are stored (what ZeRO-3 fetches at once and whether it needs leaf modules)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroplan.spec.errors import SpecError, check_positive_int

__all__ = ["MoeSpec", "DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES", "leaf_class_covered"]

#: What DeepSpeed 0.19 makes ZeRO-3 leaf modules when ``zero_optimization.leaf_module`` is absent
#: (deepspeed/runtime/zero/leaf_module_config.py, DEFAULT_LEAF_MODULE_CLASSES: transformers 4.x's
#: ModuleList-expert blocks); setting ``classes`` replaces this list, so an exported one repeats it.
DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def leaf_class_covered(qualified_name: str, classes) -> bool:
    """Whether DeepSpeed flags a module of class ``qualified_name`` as a leaf given the configured
    ``classes``: it matches an entry equal to the class's ``__name__`` or to its fully qualified name
    (deepspeed/utils/z3_leaf_module.py ``_do_set_z3_leaf_modules``)."""
    short = qualified_name.rsplit(".", 1)[-1]
    return any(c in (qualified_name, short) for c in classes)


@dataclass(frozen=True)
class MoeSpec:
    """The experts of a mixture-of-experts transformer (Shazeer et al. 2017, arXiv 1701.06538;
    Fedus et al. 2021, arXiv 2101.03961): each token goes through ``experts_per_token`` of
    ``num_experts`` routed experts in each of ``moe_layers`` blocks, plus the shared experts."""

    num_experts: int
    """Routed experts per MoE layer E (``num_experts``, ``num_local_experts``, ``n_routed_experts``)."""
    experts_per_token: int
    """Routed experts each token goes through, top-k (``num_experts_per_tok``)."""
    moe_layers: int
    """Blocks whose MLP is an MoE block (the others are dense: ``first_k_dense_replace``,
    ``mlp_only_layers``, ``decoder_sparse_step``)."""
    expert_ffn_size: int
    """Inner width I of one routed expert (``moe_intermediate_size``)."""
    expert_params: int
    """Parameters of one routed expert (3·h·I for a gated expert, plus its biases)."""
    shared_ffn_size: int = 0
    """Inner width of the shared expert MLP every token also goes through (0: none)."""
    router_params: int = 0
    """Parameters of one layer's router (E·h, plus a bias where the model has one)."""
    fused_experts: bool = True
    """The layer's experts are fused 3-D parameters (transformers 5: ``gate_up_proj [E, 2I, h]``,
    ``down_proj [E, h, I]``), so ZeRO-3 gathers all of a layer's experts at once; False: an
    ``nn.ModuleList`` of expert MLPs (transformers 4.x, remote-code models)."""
    expert_saved_widths: int = 4
    """I-wide tensors one expert saves per routed token copy for backward (transformers 5's
    SwiGLU experts: gate, up, SiLU(gate) and their product = 4; gpt-oss's clamped SwiGLU: 7)."""
    leaf_module_classes: tuple[str, ...] = field(default=())
    """Fully qualified classes of MoE blocks whose experts are a ModuleList and that DeepSpeed's
    default ``zero_optimization.leaf_module.classes`` does not list: ZeRO-3 needs them as leaf
    modules (``zeroplan.dsconfig.rules.moe``)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "moe_layers", "expert_ffn_size", "expert_params", "expert_saved_widths"):
            check_positive_int(name, getattr(self, name), maximum=10**12)
        for name in ("shared_ffn_size", "router_params"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{name}={value!r} is not valid; give a whole number >= 0")
        if self.experts_per_token > self.num_experts:
            raise SpecError(
                f"experts_per_token={self.experts_per_token} exceeds num_experts={self.num_experts}; "
                "a token cannot go through more experts than there are"
            )
        if not isinstance(self.fused_experts, bool):
            raise SpecError(f"fused_experts={self.fused_experts!r} is not valid; give true or false")
        object.__setattr__(self, "leaf_module_classes", tuple(self.leaf_module_classes))

    @property
    def routed_params(self) -> int:
        """Routed expert parameters in the whole model: moe_layers · E · expert_params."""
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def inactive_params(self) -> int:
        """Routed expert parameters a token does not touch: moe_layers · (E − k) · expert_params."""
        return self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params

    @property
    def layer_experts_params(self) -> int:
        """One layer's routed experts, E · expert_params: what ZeRO-3 fetches at once when they are
        fused parameters of one module (Qwen3-30B-A3B: 128 · 3 · 2048 · 768 = 604M)."""
        return self.num_experts * self.expert_params

    def as_dict(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "moe_layers": self.moe_layers,
            "expert_ffn_size": self.expert_ffn_size,
            "expert_params": self.expert_params,
            "shared_ffn_size": self.shared_ffn_size,
            "router_params": self.router_params,
            "fused_experts": self.fused_experts,
            "expert_saved_widths": self.expert_saved_widths,
            "leaf_module_classes": list(self.leaf_module_classes),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "MoeSpec":
        d = dict(data)
        d["leaf_module_classes"] = tuple(d.get("leaf_module_classes", ()))
        return cls(**d)
