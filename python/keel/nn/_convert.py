"""``keel.nn.convert``: torch's norm and loss modules in a model swapped for Keel's."""
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["convert"]


def convert(module: nn.Module) -> nn.Module:
    """Replaces each ``torch.nn.RMSNorm``, ``torch.nn.LayerNorm`` and
    ``torch.nn.CrossEntropyLoss`` in ``module``'s tree by Keel's module of the
    same name, and each Hugging Face ``LlamaRMSNorm`` (and the copies of it
    that ``_HF_LLAMA_NORMS`` names, in ``transformers.models``) by
    ``keel.nn.LlamaRMSNorm``, and returns ``module`` (or its replacement, where
    ``module`` is itself one of those), as
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does for batch norms.

    Each replacement holds the very parameters and buffers of the module it
    replaces (the same ``Parameter`` objects, so an optimizer made before the
    conversion still updates them, and the state dict's keys and values do not
    change), its settings (``eps``, ``normalized_shape``, ``ignore_index``,
    ``reduction``, ``label_smoothing``) and its ``training`` flag. A module
    that stands at several places in the tree gets one replacement, standing
    at each. Modules of other classes, subclasses of these three among them
    (a parametrized ``LayerNorm`` is one), are left as they are.

    Raises:
        ValueError: where a module to replace has hooks of its own (forward,
            backward or state-dict hooks), which the replacement would not
            have: remove them, convert, then register them on the new module.
            Nothing in the tree is changed then.

    Keel's ops run on CPU and CUDA tensors (float32, float16, bfloat16, and
    float64 on CPU); a converted model on another device, or in another dtype,
    raises an error naming the op and the argument on its first call.
    """
    sites: List[Tuple[Optional[nn.Module], str, nn.Module]] = []
    _walk(None, "", module, "", sites, set())
    done: Dict[int, nn.Module] = {}
    for parent, name, m in sites:
        if id(m) not in done:  # a module met at several places: one replacement
            done[id(m)] = _replacement(m)
        if parent is not None:
            parent._modules[name] = done[id(m)]
    return done.get(id(module), module)


_TYPES = (nn.RMSNorm, nn.LayerNorm, nn.CrossEntropyLoss)

# Hugging Face's RMSNorm classes whose forward is LlamaRMSNorm's, `weight *
# (x / rms).to(x.dtype)` (transformers marks them "Copied from" it or generates
# them from it), matched by name in a `transformers.models` module. Others of
# the same name pattern may compute otherwise (Gemma's scales by `1 + weight`
# in float32) and are left alone.
_HF_LLAMA_NORMS = frozenset({
    "LlamaRMSNorm",
    "MistralRMSNorm",
    "MixtralRMSNorm",
    "Qwen2RMSNorm",
    "Qwen2MoeRMSNorm",
    "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm",
})


def _is_hf_llama_norm(m: nn.Module) -> bool:
    """Whether `m` is one of ``_HF_LLAMA_NORMS`` as transformers builds it: one
    1-d ``weight`` parameter, a number ``variance_epsilon``, nothing else held."""
    kind = type(m)
    if kind.__name__ not in _HF_LLAMA_NORMS or not kind.__module__.startswith("transformers.models."):
        return False
    w = m._parameters.get("weight")
    eps = m.__dict__.get("variance_epsilon")
    return (
        set(m._parameters) == {"weight"}
        and isinstance(w, nn.Parameter)
        and w.dim() == 1
        and isinstance(eps, (int, float))
        and not isinstance(eps, bool)
        and not m._buffers
        and not m._modules
    )


def _replaced(m: nn.Module) -> bool:
    return type(m) in _TYPES or _is_hf_llama_norm(m)

# The hook dicts that a module's replacement would not carry (torch 2.10 on
# has each; `getattr` with a default keeps a later torch that drops one working).
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _walk(parent: Optional[nn.Module], name: str, m: nn.Module, path: str,
          sites: list, seen: set) -> None:
    """Records each place (parent, name) where a module to replace stands, at
    and below `m`, checking each such module first, so that a refusal leaves
    the tree unchanged. A module met again is recorded again, not walked again."""
    if _replaced(m):
        hooked = [h for h in _HOOKS if getattr(m, h, None)]
        if hooked:
            where = f"at '{path}'" if path else "(the module passed)"
            kind = f"torch.nn.{type(m).__name__}" if type(m) in _TYPES else f"{type(m).__module__}.{type(m).__qualname__}"
            raise ValueError(
                f"keel.nn.convert: the {kind} {where} has hooks ({', '.join(hooked)}), "
                "which its replacement would not have: remove them, convert, and register them again"
            )
        sites.append((parent, name, m))
    if id(m) in seen:
        return
    seen.add(id(m))
    for child_name, child in m._modules.items():
        if child is not None:
            _walk(m, child_name, child, f"{path}.{child_name}" if path else child_name, sites, seen)


def _replacement(m: nn.Module) -> nn.Module:
    """Keel's module for `m`, holding `m`'s own parameters and buffers."""
    from . import CrossEntropyLoss, LayerNorm, LlamaRMSNorm, RMSNorm

    if _is_hf_llama_norm(m):
        with torch.device("meta"):
            new = LlamaRMSNorm(m.weight.shape[0], m.variance_epsilon)
        new.weight = m.weight
    elif type(m) is nn.CrossEntropyLoss:
        new = CrossEntropyLoss(None, ignore_index=m.ignore_index, reduction=m.reduction,
                               label_smoothing=m.label_smoothing)
        new.weight = m.weight  # the same buffer (or None), as registered
    else:
        # Made on the meta device, then given `m`'s own tensors: no throwaway
        # parameters are allocated or initialised on the real device.
        with torch.device("meta"):
            if type(m) is nn.RMSNorm:
                new = RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine)
            else:
                new = LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, bias=m.bias is not None)
        new.weight = m.weight
        if isinstance(new, LayerNorm):
            new.bias = m.bias
    new.train(m.training)
    return new
