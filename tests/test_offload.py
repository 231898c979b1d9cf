"""Activation offload: layers whose saved activations wait in host memory train exactly like layers
that keep them, alone and beside recomputed and compiled layers, and every activation is brought back
ahead of its layer's backward pass."""

import pytest
import torch

from longqa.config import ConfigError, load_config
from longqa.config.checks import check_layer_memory
from longqa.config.support import check_machine
from longqa.model.attention import use_longqa_attention
from longqa.model.load import ModelError, arrange_layer_memory, compile_decoder_layers, qwen3_config
from longqa.model.offload import ActivationOffload
from longqa.train.actor import Actor, Samples

LAYERS = 6
PROMPT, RESPONSES = 40, (7, 19, 12)  # the one packed group every test here trains on


def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = qwen3_config(101, hidden_size=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().train()


def gradients(m):
    """Loss and every parameter's gradient for one fixed packed group through the actor's own path."""
    cfg = load_config(
        None,
        [
            "actor.shared_prompt=true",
            "rollout.n=3",
            "data.train_batch_size=1",
            "actor.ppo_mini_batch_size=1",
            "actor.attention_backend=dense",
        ],
    )
    actor = Actor(m, cfg, 1, next(m.parameters()).device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 101, (PROMPT,), generator=g).tolist()
    responses = [torch.randint(1, 101, (r,), generator=g).tolist() for r in RESPONSES]
    total = 0.0
    for micro in actor.micro_batches(Samples([prompt] * 3, responses, torch.zeros(3), 3), [0, 1, 2]):
        logp, _, mask = actor.forward(actor.scorer, micro)
        loss = (logp * mask).sum()
        loss.backward()
        total += loss.item()
    return total, {name: p.grad.clone() for name, p in m.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients of the same model keeping every activation on its device."""
    return gradients(model())


def offloaded(checkpoint_fraction=0.0, offload_fraction=0.5, compiled=False):
    m = model()
    offload = arrange_layer_memory(m, checkpoint_fraction, offload_fraction)
    offload.min_bytes = 0  # every activation, however small, travels here
    if compiled:
        compile_decoder_layers(m, backend="inductor")
    return m, offload


def device_saved_activations(m):
    """Loss, gradients and, per decoder layer, the activation elements its forward pass left in autograd's
    own storage: what neither recomputation nor offload took over. The count comes from an outermost
    saved-tensor hook, so the hooks that checkpointing and offload push inside a layer receive that layer's
    tensors instead of it (weights, saved by reference, are not counted)."""
    layer, saved = [None], [0] * LAYERS
    for i, decoder_layer in enumerate(m.base_model.layers):
        decoder_layer.register_forward_pre_hook(lambda *_, i=i: layer.__setitem__(0, i))
        decoder_layer.register_forward_hook(lambda *_: layer.__setitem__(0, None))

    def count(t):
        base = t if t._base is None else t._base
        if layer[0] is not None and not isinstance(base, torch.nn.Parameter):
            saved[layer[0]] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss, got = gradients(m)
    return loss, got, saved


@pytest.mark.parametrize("checkpoint_fraction,offload_fraction", [(0.0, 0.5), (0.0, 1.0), (0.5, 1 / 3)])
def test_offloaded_layers_give_the_gradients_of_layers_that_keep_their_activations(
    checkpoint_fraction, offload_fraction, reference
):
    reference_loss, reference = reference
    m, offload = offloaded(checkpoint_fraction, offload_fraction)
    count = round(offload_fraction * LAYERS)
    assert offload.offloaded == count
    use_longqa_attention(m)  # probes each layer once
    _, _, kept = device_saved_activations(model())
    loss, got, saved = device_saved_activations(m)
    recomputed = round(checkpoint_fraction * LAYERS)
    layer_input = (PROMPT + sum(RESPONSES)) * m.config.hidden_size  # the packed hidden states a layer takes
    # Offloaded layers leave nothing on the device, recomputed ones at most the input they recompute from
    # (where the checkpoint keeps it depends on the transformers version), the others what every layer keeps.
    assert saved[:count] == [0] * count
    assert max(saved[count : count + recomputed], default=0) <= layer_input, saved
    assert saved[count + recomputed :] == kept[count + recomputed :]
    assert min(kept) > 10 * layer_input
    assert loss == reference_loss
    for name, grad in reference.items():
        assert torch.equal(got[name], grad), name
    assert offload.bytes_offloaded > 0
    assert offload.late_loads == 0  # every copy back had started before its layer's backward pass
    assert offload.pending == {}  # and nothing was left behind


def test_the_copies_are_what_the_backward_pass_reads():
    """Changing the host copies changes the gradients: the offloaded layers' backward reads them, not
    tensors still held on the device."""
    m, offload = offloaded()
    reference_loss, reference = gradients(m)
    m.zero_grad()
    pack = offload._pack

    def corrupting(index, t):
        saved = pack(index, t)
        if hasattr(saved, "host"):
            saved.host.mul_(1.5)
        return saved

    offload._pack = corrupting
    _, got = gradients(m)
    assert any(not torch.equal(got[name], grad) for name, grad in reference.items())


def test_a_saved_view_comes_back_with_its_strides():
    class SavesATranspose(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            t = x.t()
            ctx.save_for_backward(t)
            ctx.layout = t.stride()
            return (t * t).sum()

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            assert t.stride() == ctx.layout and not t.is_contiguous()
            return 2 * grad * t.t()

    offload = ActivationOffload(1, min_bytes=0)
    x = torch.randn(8, 5, requires_grad=True)
    y = torch.randn(8, 5)
    out = offload.run(0, None, lambda a: SavesATranspose.apply(a * y), x)
    out.backward()
    assert torch.allclose(x.grad, 2 * (x * y) * y)
    assert offload.bytes_offloaded > 0


def test_weights_and_broadcast_views_stay_where_they_are():
    offload = ActivationOffload(1, min_bytes=0)
    offload.pending[0] = []
    weight = torch.nn.Parameter(torch.randn(4, 4))
    assert offload._pack(0, weight) is weight
    assert offload._pack(0, weight.t()) is not None and offload.pending[0] == []
    wide = torch.randn(4, 1).expand(4, 6)
    assert offload._pack(0, wide) is wide
    assert offload.bytes_offloaded == 0


@pytest.mark.slow
def test_compiled_offloaded_layers_give_the_eager_gradients(reference):
    """Compiled backward graphs assert the strides of what they saved: the copies must come back alike."""
    _, reference = reference
    m, offload = offloaded(0.0, 0.5, compiled=True)
    _, got = gradients(m)
    for name, grad in reference.items():
        assert torch.allclose(got[name], grad, atol=1e-5, rtol=1e-4), name
    assert offload.bytes_offloaded > 0 and offload.late_loads == 0


def test_offloaded_and_recomputed_layers_must_fit_the_model():
    with pytest.raises(ModelError, match="more than the model's 6"):
        arrange_layer_memory(model(), 0.5, 2 / 3)
    cfg = load_config(
        None, ["model.activation_offload=0.5", "model.gradient_checkpointing=true", "model.checkpoint_fraction=0.75"]
    )
    with pytest.raises(ConfigError, match="add up to more than all the layers"):
        check_layer_memory(cfg)
    with pytest.raises(ConfigError, match="on cpu they are in host memory already"):
        check_machine(load_config(None, ["model.activation_offload=0.25"]), "cpu")
    with pytest.raises(ConfigError, match="model.activation_offload"):
        load_config(None, ["model.activation_offload=1.5"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: copies to pinned memory on side streams")
def test_offloaded_layers_on_a_gpu_give_the_gradients_of_layers_that_keep_them():
    _, reference = gradients(model().cuda())
    m, offload = offloaded(0.0, 0.5)
    _, got = gradients(m.cuda())
    for name, grad in reference.items():
        assert torch.allclose(got[name], grad, atol=1e-6, rtol=1e-5), name
    assert offload.bytes_offloaded > 0 and offload.late_loads == 0
