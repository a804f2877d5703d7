"""keel.nn.convert on Hugging Face's LlamaRMSNorm family, and keel.nn.LlamaRMSNorm:
the module as transformers writes it (defined here, under transformers' module
name: transformers itself is not a test dependency) replaced by Keel's, with the
same parameter, epsilon and values."""
import pytest
import torch
from torch import nn

import keel
from conftest import assert_close, devices


def hf_class(name, module="transformers.models.llama.modeling_llama"):
    """A class as transformers defines LlamaRMSNorm (and its copies), under `name`
    in `module`."""

    class Norm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    Norm.__name__ = Norm.__qualname__ = name
    Norm.__module__ = module
    return Norm


LlamaRMSNorm = hf_class("LlamaRMSNorm")
Qwen2RMSNorm = hf_class("Qwen2RMSNorm", "transformers.models.qwen2.modeling_qwen2")


class Block(nn.Module):
    def __init__(self, n, norm):
        super().__init__()
        self.input_layernorm = norm(n, eps=1e-5)
        self.proj = nn.Linear(n, n, bias=False)
        self.post_attention_layernorm = norm(n, eps=1e-5)

    def forward(self, x):
        return self.post_attention_layernorm(self.proj(self.input_layernorm(x)) + x)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("norm", [LlamaRMSNorm, Qwen2RMSNorm])
def test_converted_hf_norms_give_hf_values_and_gradients(device, norm):
    torch.manual_seed(0)
    model = Block(256, norm).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for m in (model.input_layernorm, model.post_attention_layernorm):
            m.weight.uniform_(0.5, 2.0)
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    want = model(x)
    want.float().square().sum().backward()
    want_gx, want_gw = x.grad.clone(), model.input_layernorm.weight.grad.clone()
    weight = model.input_layernorm.weight
    state = {k: v.clone() for k, v in model.state_dict().items()}

    assert keel.nn.convert(model) is model
    assert type(model.input_layernorm) is keel.nn.LlamaRMSNorm
    assert model.input_layernorm.weight is weight and model.input_layernorm.variance_epsilon == 1e-5
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert repr(model.input_layernorm) == "LlamaRMSNorm((256,), eps=1e-05)"

    x.grad = None
    model.zero_grad()
    got = model(x)
    # The same values but where the two float32 sums of squares round x / rms to
    # different sides of a tie (the second norm's input also carries the first's).
    assert (got != want).double().mean().item() < 2e-3
    assert_close(got, want, torch.bfloat16)
    got.float().square().sum().backward()
    assert_close(x.grad, want_gx, torch.bfloat16, scale=4.0)
    assert_close(model.input_layernorm.weight.grad, want_gw, torch.bfloat16, scale=4.0 * 8)


@pytest.mark.parametrize("device", devices())
def test_float32_weight_with_bfloat16_input_promotes_as_hf(device):
    torch.manual_seed(1)
    hf = LlamaRMSNorm(128).to(device)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 2.0)
    ours = keel.nn.convert(hf)
    assert type(ours) is keel.nn.LlamaRMSNorm and ours.weight is hf.weight
    x = torch.randn(16, 128, device=device).to(torch.bfloat16)
    want = hf(x)
    got = ours(x)
    assert got.dtype == want.dtype == torch.float32
    assert (got != want).double().mean().item() < 1e-3
    assert_close(got, want, torch.bfloat16)


def test_lookalikes_outside_transformers_and_other_shapes_are_left_alone():
    outside = hf_class("LlamaRMSNorm", "my_models.llama")(8)
    gemma = hf_class("GemmaRMSNorm", "transformers.models.gemma.modeling_gemma")(8)
    extra = LlamaRMSNorm(8)
    extra.register_buffer("scale", torch.ones(1))
    model = nn.Sequential(outside, gemma, extra)
    keel.nn.convert(model)
    assert model[0] is outside and model[1] is gemma and model[2] is extra


def test_an_hf_norm_with_hooks_is_refused_naming_its_class():
    model = nn.Sequential(nn.Linear(8, 8), LlamaRMSNorm(8))
    model[1].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"the transformers.models.llama.modeling_llama.LlamaRMSNorm at '1' has hooks"):
        keel.nn.convert(model)
    assert type(model[1]) is LlamaRMSNorm


def test_llama_rms_norm_module_on_its_own():
    m = keel.nn.LlamaRMSNorm(64, eps=1e-5, dtype=torch.bfloat16)
    assert set(m.state_dict()) == {"weight"} and m.weight.dtype == torch.bfloat16
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(m(x), keel.rms_norm(x, m.weight, 1e-5, round_before_weight=True))
    traced = torch.fx.symbolic_trace(m)
    assert torch.equal(traced(x), m(x))
