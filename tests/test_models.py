"""``cupyln.torch.replace_norms`` on models as people load them: tiny configurations of Hugging
Face transformers' families (no download). CPU tier: each family's norm modules are taken,
recognised as what they compute (kind, 1 + w, rounding), with state_dict keys, hooks and
outputs kept (on the CPU the swapped modules run torch's functions); a norm-like module that
computes something else is left, logged, or refused with ``strict``. GPU tier: the swapped
models against the untouched ones, float32 loss and every gradient, and bfloat16 logits."""

import logging

import pytest

from .conftest import requires_gpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
clt = pytest.importorskip("cupyln.torch")

from cupyln.torch._models import Norm  # noqa: E402

LLAMA = Norm(True, 0.0, "variance_epsilon", "llama")
GEMMA = Norm(True, 1.0, "eps", "none")
OLMO2 = Norm(True, 0.0, "variance_epsilon", "none")
T5 = Norm(True, 0.0, "variance_epsilon", "t5")
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, pad_token_id=0)  # fmt: skip
FAMILIES = {  # config class, its keywords, the norm, the modules taken
    "Llama": ("LlamaConfig", {}, LLAMA, 5),
    "Mistral": ("MistralConfig", {}, LLAMA, 5),
    "Qwen2": ("Qwen2Config", {}, LLAMA, 5),
    "Qwen3": ("Qwen3Config", {"head_dim": 16}, LLAMA, 9),  # with q_norm and k_norm
    "Phi3": ("Phi3Config", {}, LLAMA, 5),
    "Gemma": ("GemmaConfig", {"head_dim": 16}, GEMMA, 5),
    "Gemma2": ("Gemma2Config", {"head_dim": 16}, GEMMA, 9),
    "Gemma3": ("Gemma3TextConfig", {"head_dim": 16}, GEMMA, 13),
    "OLMo2": ("Olmo2Config", {}, OLMO2, 9),
    "DeepSeek-V3": ("DeepseekV3Config", dict(moe_intermediate_size=32, n_routed_experts=4,
                    num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32,
                    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    first_k_dense_replace=1), LLAMA, 9),
}  # fmt: skip


def decoder(name, dtype=torch.float32, device="cpu"):
    cfg_name, kw, _, _ = FAMILIES[name]
    cfg = getattr(transformers, cfg_name)(**DECODER, **kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(device, dtype).eval()


def t5(device="cpu", dtype=torch.float32):
    cfg = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg).to(device, dtype).eval()


def taken(model) -> list:
    return [m._cupyln_norm for m in model.modules() if hasattr(m, "_cupyln_norm")]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_is_taken_as_what_it_computes(name):
    model = decoder(name)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    keys = list(model.state_dict())
    norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    cls = type(norm)
    fired = []
    norm.register_forward_hook(lambda *a: fired.append(1))
    with torch.no_grad():
        before = model(ids).logits
    clt.replace_norms(model, strict=True)
    _, _, want, count = FAMILIES[name]
    assert taken(model) == [want] * count
    assert list(model.state_dict()) == keys and isinstance(norm, cls) and type(norm) is not cls
    fired.clear()
    with torch.no_grad():
        after = model(ids).logits
    assert fired and torch.equal(before, after)  # on the CPU: torch's own functions


def test_t5_and_gpt2():
    model = t5()
    clt.replace_norms(model, strict=True)
    assert set(taken(model)) == {T5} and len(taken(model)) == 12  # 2 + 3 a layer, 2 finals
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4,
                                                                vocab_size=128))  # fmt: skip
    clt.replace_norms(gpt2, strict=True)
    norms = [m for m in gpt2.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 5 and all(type(m) is clt.LayerNorm for m in norms)


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["Llama", "T5"])
def test_weights_of_any_dtype_keep_the_rounding(family, wdt):
    """T5 rounds the normalized x to a 16-bit weight's dtype, Llama to x's: each is recognised
    at every weight dtype, and the swapped module returns the original's dtype on float32 and
    bfloat16 rows alike."""
    import copy

    plain = _first_norm(t5() if family == "T5" else decoder(family)).to(dtype=wdt)
    swapped = copy.deepcopy(plain)
    clt.replace_norms(torch.nn.Sequential(swapped), strict=True)
    assert taken(torch.nn.Sequential(swapped)) == [T5 if family == "T5" else LLAMA]
    for xdt in (torch.float32, torch.bfloat16):
        x = torch.randn(4, plain.weight.numel()).to(xdt)
        with torch.no_grad():
            assert plain(x).dtype == swapped(x).dtype, (xdt, plain(x).dtype, swapped(x).dtype)


class ScaledByStd(torch.nn.Module):
    """Norm-like (a weight, an eps) but none of cupyln's norms: x / (std + eps) * w."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = 1e-5

    def forward(self, x):
        return x / (x.std(-1, keepdim=True) + self.eps) * self.weight


class WithGate(ScaledByStd):
    """Norm-like, but its forward takes a second argument (a probe cannot call it)."""

    def forward(self, x, gate):
        return super().forward(x) * gate


def test_what_it_cannot_take_is_left_logged_or_refused(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), ScaledByStd(32), torch.nn.LayerNorm(32),
                                WithGate(32))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="cupyln"):
        clt.replace_norms(model)
    assert type(model[1]) is ScaledByStd and type(model[2]) is clt.LayerNorm
    assert type(model[3]) is WithGate
    assert "left 2 norm-like modules: ['1', '3']" in caplog.text
    with pytest.raises(ValueError, match=r"cannot take: \['0'\]"):
        clt.replace_norms(torch.nn.Sequential(ScaledByStd(8)), strict=True)


# ------------------------------------------------------------------------------- GPU tier
def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("name", ["Llama", "Qwen3", "Gemma2", "OLMo2"])
def test_swapped_models_match_on_the_gpu(name):
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(2)).cuda()
    plain = decoder(name, device="cuda")
    swapped = decoder(name, device="cuda")
    clt.replace_norms(swapped, strict=True)
    loss0, g0 = _loss_and_grads(plain, ids)
    loss1, g1 = _loss_and_grads(swapped, ids)
    assert abs(float(loss1 - loss0)) <= 1e-6 * abs(float(loss0)), (loss0, loss1)
    for k, g in g0.items():
        scale = float(g.abs().max()) or 1.0
        assert float((g1[k] - g).abs().max()) <= 1e-5 * scale, k
    plain, swapped = plain.bfloat16(), swapped.bfloat16()
    with torch.no_grad():
        a, b = plain(ids).logits.float(), swapped(ids).logits.float()
    assert float((a - b).abs().max()) <= 0.05 * float(a.abs().max()), name  # bf16 rounding


def _first_norm(model):
    return next(m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm")))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
@pytest.mark.parametrize("family", ["Llama", "Gemma2", "OLMo2", "T5"])
def test_each_rounding_on_the_gpu(family, wdt):
    """One norm module of each rounding, weights of either dtype, bf16 rows: the swapped module
    returns the original's dtype and its values to within one rounding of it."""
    import copy

    plain = _first_norm(t5() if family == "T5" else decoder(family))
    with torch.no_grad():
        plain.weight.copy_(torch.rand(plain.weight.shape) + 0.5)
    plain = plain.to("cuda", wdt)
    swapped = copy.deepcopy(plain)
    clt.replace_norms(torch.nn.Sequential(swapped), strict=True)
    x = torch.randn(64, plain.weight.numel(), device="cuda").bfloat16() - 2.3
    with torch.no_grad():
        a, b = plain(x), swapped(x)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
    step = 2.0**-7  # a bfloat16 rounding, of y or of the normalized x before the weight
    assert torch.allclose(a.float(), b.float(), rtol=step, atol=step), family
